"""Plain autoregressive decoding on the target adapter: the reference for losslessness and speed.

`stream_plain` is continuous batching: up to `max_batch` requests decode together, finished ones leave and queued
ones join at once, so a long answer never holds a half-empty batch (regeneration runs on this).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterator

import torch

from dspark.decoding.requests import GenerationResult, RequestState, pad_prompts, without_early_stops
from dspark.sampling import SamplingParams, next_token
from dspark.target import Target


@torch.no_grad()
def stream_plain(
    target: Target,
    queue: deque,
    max_batch: int,
    max_new_tokens: int,
    sampling: SamplingParams = SamplingParams(),
    stop_token_ids: set[int] | None = None,
    on_tokens=None,
    min_tokens: int = 0,
) -> Iterator[tuple[object, GenerationResult]]:
    """Decode (key, prompt_ids) items popped from `queue` (no stop token before min_tokens); yields (key, result)
    as each finishes.

    The caller may append to `queue` between yields (e.g. the next turn of a conversation)."""
    stop = target.stop_token_ids if stop_token_ids is None else stop_token_ids
    cache = target.new_cache(0)
    rows: list[tuple[object, RequestState, torch.Generator, float]] = []
    last = torch.empty(0, target.vocab_size, device=target.device)
    admitted = 0
    # A prefill costs about as much as a decode step of the whole batch: admit in groups, not one row at a time.
    admit_at = max(1, max_batch // 4)
    while True:
        live = [i for i, (_, state, _, _) in enumerate(rows) if not state.finished]
        if not live and not queue:
            break
        admit = bool(queue) and (max_batch - len(live) >= min(admit_at, len(queue)) or not live)
        # Finished rows stay in the cache (decoding a token nobody reads) until a quarter of the batch has finished
        # or new requests join: each compaction copies the whole cache, which cost a third of regeneration's time
        # when it ran at every finished request.
        if len(live) < len(rows) and (admit or 4 * (len(rows) - len(live)) >= len(rows)):
            keep = torch.tensor(live, dtype=torch.long, device=target.device)
            cache.select(keep)
            last = last[keep]
            rows = [rows[i] for i in live]
        if admit:
            batch = [queue.popleft() for _ in range(min(max_batch - len(rows), len(queue)))]
            states = [
                RequestState(admitted + i, prompt, max_new_tokens, stop, target.context_window, min_tokens=min_tokens)
                for i, (_, prompt) in enumerate(batch)
            ]
            gens = SamplingParams(seed=None if sampling.seed is None else sampling.seed + admitted).generators(
                len(batch)
            )
            admitted += len(batch)
            # A request's time runs from its prefill, as the speculative engine's and every other engine's we race.
            started = time.perf_counter()
            fresh = target.new_cache(len(batch))
            ids, lengths = pad_prompts([prompt for _, prompt in batch], target.device)
            logits = target.prefill(fresh, ids, lengths).logits[:, 0]
            cache.merge(fresh)
            last = torch.cat([last, logits])
            rows += [(key, state, g, started) for (key, _), state, g in zip(batch, states, gens)]

        allowed = without_early_stops(last[:, None], [state for _, state, _, _ in rows])[:, 0]
        tokens = next_token(allowed, sampling, [g for _, _, g, _ in rows]).tolist()
        for (key, state, _, started), tok in zip(rows, tokens):
            if state.finished:
                continue
            taken = state.commit([tok])
            if on_tokens and taken:
                on_tokens(key, taken)
            if state.finished:
                yield key, state.result(time.perf_counter() - started)
        if any(not state.finished for _, state, _, _ in rows):
            fed = torch.tensor([[state.output[-1]] for _, state, _, _ in rows], device=target.device)
            last = target.forward(cache, fed).logits[:, -1]


def generate_plain(
    target: Target,
    prompts: list[list[int]],
    max_new_tokens: int,
    sampling: SamplingParams = SamplingParams(),
    stop_token_ids: set[int] | None = None,
    on_tokens=None,
    max_batch: int | None = None,
    min_tokens: int = 0,
) -> list[GenerationResult]:
    """Decode every prompt, one token per target forward (no stop token before min_tokens); results in prompt
    order."""
    for i, p in enumerate(prompts):  # refuse bad requests before any compute
        RequestState(i, p, max_new_tokens, set(), target.context_window, min_tokens=min_tokens)
    queue = deque(enumerate(prompts))
    batch = max_batch or len(prompts)
    results = dict(stream_plain(target, queue, batch, max_new_tokens, sampling, stop_token_ids, on_tokens, min_tokens))
    return [results[i] for i in range(len(prompts))]
