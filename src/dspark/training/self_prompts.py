"""User requests the target writes itself, from its own chat template (Magpie, Xu et al. 2024).

Given only the conversation's opening up to a user turn, an instruction-tuned model samples a request of the kind it
was aligned on: requests from its own distribution, beside the templates of `sources`, for the drafter to learn the
answers to. Each written turn is kept only if the model closed it itself, it has a few words, it does not loop, no
earlier one says the same, and it shares no 8-word run with the evaluation prompts.
"""

from __future__ import annotations

import re

from dspark.decoding.plain import generate_plain
from dspark.sampling import SamplingParams
from dspark.target import Target
from dspark.training.sources import overlaps

MIN_WORDS = 4
REPEAT_N = 4  # a turn whose word 4-grams are less than half distinct loops


def normalised(text: str) -> str:
    """The turn's words, lower-cased, one space apart: two turns that say the same read the same."""
    return " ".join(re.findall(r"\w+", text.lower()))


def rejection(text: str, finish_reason: str, seen: set[str], forbidden: set[str]) -> str | None:
    """Why a written turn is dropped (None: kept); `seen` holds the `normalised` turns kept so far."""
    said = normalised(text)
    words = said.split()
    if finish_reason != "stop":
        return "unfinished"
    if len(words) < MIN_WORDS:
        return "short"
    grams = [tuple(words[i : i + REPEAT_N]) for i in range(len(words) - REPEAT_N + 1)]
    if len(grams) >= 8 and len(set(grams)) < len(grams) / 2:
        return "repetitive"
    if said in seen:
        return "duplicate"
    if overlaps(text, forbidden):
        return "overlap"
    return None


def write_user_turns(
    target: Target,
    count: int,
    seed: int,
    forbidden: set[str],
    temperature: float = 1.0,
    max_new_tokens: int = 128,
    batch_size: int = 32,
    attempts: int = 4,
) -> tuple[list[list[str]], dict]:
    """Up to `count` one-turn prompts the target wrote, sampling at `temperature` from its user-turn opening; at most
    `attempts` x `count` samples are drawn. Returns (prompts, report: samples drawn, why any were dropped, and how
    many good ones were left over past `count`)."""
    opening, closing = target.user_turn_template()
    stop = target.stop_token_ids | {closing}
    prompts: list[list[str]] = []
    seen: set[str] = set()
    dropped: dict[str, int] = {}
    drawn = 0
    while len(prompts) < count and drawn < attempts * count:
        chunk = min(4 * batch_size, 2 * (count - len(prompts)), attempts * count - drawn)  # ~1 in 3 is dropped
        sampling = SamplingParams(temperature=temperature, seed=seed + drawn)  # request i: seed + drawn + i
        results = generate_plain(target, [opening] * chunk, max_new_tokens, sampling, stop, max_batch=batch_size)
        drawn += chunk
        for result in results:
            ids = [t for t in result.token_ids if t not in stop]
            text = target.tokenizer.decode(ids, skip_special_tokens=True).strip()
            reason = rejection(text, result.finish_reason, seen, forbidden)
            if reason:
                dropped[reason] = dropped.get(reason, 0) + 1
            elif len(prompts) < count:
                seen.add(normalised(text))
                prompts.append([text])
    unused = drawn - len(prompts) - sum(dropped.values())  # kept-worthy samples past `count`
    return prompts, {"samples": drawn, "kept": len(prompts), "dropped": dropped, "unused": unused}
