"""Chat data files (prompts and regenerated answers): reading and validating records, and turning them into token
sequences with assistant loss masks. Shared by training, the n-gram drafter, calibration and the benchmarks.

Accepted inputs: JSONL of OpenAI-style {"messages": [{"role", "content"}, ...]}, evaluation-style {"turns": [...]}
(user turns), or {"prompt": "..."}; or a .txt file with one prompt per line. Every record is validated before any
compute; a bad record is reported with its file and line.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from dspark.chat import prompt_ids
from dspark.errors import DSparkError
from dspark.fsutil import jsonl_lines, read_jsonl

ROLES = ("system", "user", "assistant")


def _messages(record: dict, where: str) -> list[dict]:
    if "messages" in record:
        messages = record["messages"]
    elif "turns" in record:
        messages = [{"role": "user", "content": t} for t in record["turns"]]
    elif "prompt" in record:
        messages = [{"role": "user", "content": record["prompt"]}]
    else:
        raise DSparkError(f"{where}: a record needs 'messages', 'turns' or 'prompt' (found keys {sorted(record)})")
    if not isinstance(messages, list) or not messages:
        raise DSparkError(f"{where}: 'messages' must be a non-empty list")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            role = m.get("role") if isinstance(m, dict) else m
            raise DSparkError(f"{where}: message {i} has unknown role {role!r}; roles are {', '.join(ROLES)}")
        if not isinstance(m.get("content"), str) or not m["content"].strip():
            raise DSparkError(f"{where}: message {i} ({m['role']}) has empty or non-text content")
    if not any(m["role"] == "user" for m in messages):
        raise DSparkError(f"{where}: the conversation has no user message")
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def read_records(path: str | Path) -> list[dict]:
    """All records of a data file (JSONL, gzipped JSONL or a .txt prompt list), validated; each gets 'id' and
    normalised 'messages'. Ids must be unique: they are how regeneration and resumed runs know what is done."""
    path = Path(path)
    if path.suffix == ".txt":
        records = [
            {"id": f"{path.stem}-{n}", "messages": [{"role": "user", "content": line.strip()}]}
            for n, line in jsonl_lines(path)
        ]
    else:
        records = []
        for (n, _), record in zip(jsonl_lines(path), read_jsonl(path)):
            where = f"{path}:{n}"
            out = dict(record)
            out["messages"] = _messages(record, where)
            out.setdefault("id", f"{path.stem}-{n}")
            if not isinstance(out["id"], (str, int)) or isinstance(out["id"], bool):
                raise DSparkError(f"{where}: 'id' must be a string or an integer")
            out["_line"] = n
            ids = out.get("assistant_token_ids")
            if ids is not None:
                answers = sum(m["role"] == "assistant" for m in out["messages"])
                if not isinstance(ids, list) or len(ids) != answers:
                    raise DSparkError(f"{where}: assistant_token_ids must hold one id list per assistant message")
                for turn in ids:
                    if not isinstance(turn, list) or not all(type(t) is int and t >= 0 for t in turn):
                        raise DSparkError(f"{where}: assistant_token_ids must be lists of non-negative integers")
            records.append(out)
    if not records:
        raise DSparkError(f"{path} holds no records")
    first_line = {}
    for r in records:
        line = r.pop("_line", None)
        if r["id"] in first_line:
            raise DSparkError(
                f"{path}: id {r['id']!r} appears twice (lines {first_line[r['id']]} and {line}); "
                "every record needs its own id"
            )
        first_line[r["id"]] = line
    return records


@dataclass
class Example:
    input_ids: list[int]
    loss_mask: list[int]  # 1 on assistant tokens
    index: int = -1  # position in the training set (feature cache lookups)
    source: str = ""  # the record's prompt source (chat, math, code, ...), for per-category evaluation

    def __len__(self) -> int:
        return len(self.input_ids)


def assistant_tokens(tokenizer, history: list[dict], answer: dict) -> list[int]:
    """The tokens the chat template gives an assistant message: full render minus the render that prompts for it
    (for a model without a template, the answer's text and the end-of-text token)."""
    if tokenizer.chat_template:
        prefix = prompt_ids(tokenizer, history)
        full = tokenizer.apply_chat_template(history + [answer], tokenize=True, return_dict=True)["input_ids"]
        if list(full[: len(prefix)]) == list(prefix):
            return list(full[len(prefix) :])
    return tokenizer.encode(answer["content"], add_special_tokens=False) + [tokenizer.eos_token_id]


def examples_from_record(tokenizer, record: dict, max_length: int) -> list[Example]:
    """One sequence per assistant turn: the chat-templated history, then the answer, which alone carries loss.

    Regenerated records carry the exact ids the target produced (`assistant_token_ids`); others are tokenised."""
    out, exact = [], record.get("assistant_token_ids")
    messages = record["messages"]
    turn = 0
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        history = messages[:i]
        prompt = prompt_ids(tokenizer, history)
        answer = list(exact[turn]) if exact else assistant_tokens(tokenizer, history, m)
        turn += 1
        ids = (prompt + answer)[:max_length]
        mask = ([0] * len(prompt) + [1] * len(answer))[:max_length]
        if sum(mask) >= 2:  # an anchor needs itself and its next token inside the mask
            out.append(Example(ids, mask, source=str(record.get("source") or "")))
    return out


def spread_slice(examples: list[Example], count: int) -> list[Example]:
    """At most `count` examples evenly spread over the list, so every data file and prompt source of a mix (files
    are concatenated one after another) is in an evaluation slice, not only the first file's."""
    if len(examples) <= count:
        return list(examples)
    return [examples[i * len(examples) // count] for i in range(count)]
