"""Regeneration: the target answers every prompt itself, so the drafter learns to imitate the target (docs/design.md §3).

Multi-turn records are answered turn by turn, each turn given the regenerated history. Continuous batching keeps
the batch full. Output JSONL is appended one finished record at a time; a restarted run skips what is already
there and drops a torn last line, so records are never duplicated or lost.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections import deque
from pathlib import Path

from tqdm import tqdm

from dspark.decoding.plain import stream_plain
from dspark.errors import DSparkError
from dspark.sampling import SamplingParams


def completed_ids(path: Path, precision: str | None = None) -> set[str]:
    """Ids already written to an output file of `regenerate`. A torn last line (a run killed mid-write, so it has no
    newline) after whole regenerated records is cut off the file; anything else that is not a regenerated record
    stops the run with the file as it was: a mistyped --out must never be truncated. With `precision`, records
    answered by our engine in another precision are refused (a resume must not mix two models' answers)."""
    if not path.exists():
        return set()
    if path.is_dir():
        raise DSparkError(f"--out {path} is a folder; give the JSONL file to write")
    data = path.read_bytes()
    lines = data.split(b"\n")
    torn = lines.pop()  # b"" when the file ends with a newline
    done, offset = set(), 0
    for n, raw in enumerate(lines, 1):
        offset += len(raw) + 1
        if not raw.strip():
            continue
        record = _regenerated_record(path, n, raw)
        answered_in = (
            record.get("backend", {}).get("dtype") if record.get("backend", {}).get("name") == "dspark" else None
        )
        if precision and answered_in and answered_in != precision:
            raise DSparkError(
                f"{path}:{n}: answered in {answered_in}, this run would answer in {precision}; resume with --dtype "
                f"{answered_in}, or write to a new --out"
            )
        done.add(record["id"])
    if torn.strip():
        if not done:  # nothing of ours before it: a file of the user's without a final newline, not a torn record
            _regenerated_record(path, len(lines) + 1, torn)
            raise DSparkError(f"{path}: its only record has no final newline; add one, or choose another --out")
        with path.open("rb+") as f:
            f.truncate(offset)
    return done


def _regenerated_record(path: Path, n: int, raw: bytes) -> dict:
    try:
        record = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DSparkError(
            f"{path}:{n}: not valid JSON ({e}); this is not a regenerate output file, or it was "
            "damaged. Fix or remove that line, or choose another --out"
        ) from e
    if not isinstance(record, dict) or "id" not in record or "assistant_token_ids" not in record:
        raise DSparkError(
            f"{path}:{n}: not a regenerated record (no id / assistant_token_ids); --out must be a new "
            "file or the output of an earlier `dspark regenerate` run, never the prompts file"
        )
    return record


class Conversations:
    """The conversations being regenerated: each keeps its user and system messages, its assistant messages replaced
    by the target's answers; the next user turn of each is queued (prompt ids) once the turn before it is answered."""

    def __init__(self, target, queue: deque, meta: dict):
        self.target, self.queue, self.meta = target, queue, meta
        self.state: dict[str, dict] = {}

    def start(self, record: dict) -> None:
        rid = record["id"]
        self.state[rid] = {"record": record, "source": record["messages"], "messages": [], "next": 0}
        self.state[rid].update(ids=[], finish=[])
        self.schedule(rid)

    def schedule(self, rid: str, follow_up: bool = False) -> None:
        """Queue the next user turn of a conversation (its history holds the answers regenerated so far). A follow-up
        turn goes to the front, so conversations finish (and are written) soon after they start."""
        s = self.state[rid]
        while s["next"] < len(s["source"]) and s["source"][s["next"]]["role"] != "user":
            if s["source"][s["next"]]["role"] == "system":
                s["messages"].append(s["source"][s["next"]])
            s["next"] += 1
        s["messages"].append(s["source"][s["next"]])
        s["next"] += 1
        item = (rid, self.target.encode_chat(s["messages"]))
        self.queue.appendleft(item) if follow_up else self.queue.append(item)

    def answered(self, rid: str, result) -> dict | None:
        """Record the target's answer to a conversation's turn: its finished record when that was the last user turn
        (the conversation is then forgotten), else None with the next turn queued."""
        s = self.state[rid]
        text = self.target.tokenizer.decode(result.token_ids, skip_special_tokens=True)
        s["messages"].append({"role": "assistant", "content": text})
        s["ids"].append(result.token_ids)
        s["finish"].append(result.finish_reason)
        if any(m["role"] == "user" for m in s["source"][s["next"] :]):
            self.schedule(rid, follow_up=True)
            return None
        del self.state[rid]
        record = {k: v for k, v in s["record"].items() if k not in ("messages", "assistant_token_ids")}
        record.update(messages=s["messages"], assistant_token_ids=s["ids"], finish_reasons=s["finish"], **self.meta)
        return record

    def finish_under_way(self) -> None:
        """Start no new conversation: only the follow-up turns of those already answered in part stay queued."""
        under_way = {rid for rid, s in self.state.items() if s["ids"]}
        kept = [item for item in self.queue if item[0] in under_way]
        self.queue.clear()
        self.queue.extend(kept)


def regenerate(
    target,
    records: list[dict],
    out_path: str | Path,
    max_new_tokens: int = 384,
    batch_size: int = 32,
    sampling: SamplingParams = SamplingParams(),
    progress: bool = True,
    llm=None,
    max_seconds: float = 0.0,
) -> dict:
    """Answer every record not yet in `out_path`, with our engine or, given `llm`, with llama.cpp. After
    `max_seconds` (0 = no limit) no new conversation starts; those under way finish and are written, so a fixed lease
    (a GPU for ten minutes) ends with whole records, and a rerun continues with the rest."""
    out_path = Path(out_path)
    done = completed_ids(out_path, target.precision if llm is None else None)
    todo = [r for r in records if r["id"] not in done]
    queue = deque()  # (conversation id, prompt ids) of the turns waiting for an answer
    if llm is None:
        backend = {"name": "dspark", "dtype": target.precision, "device": target.device.type}
        answers = stream_plain(target, queue, batch_size, max_new_tokens, sampling)
    else:
        from dspark.training.llama_backend import backend_identity, stream_llama

        backend = backend_identity(llm)
        answers = stream_llama(llm, queue, max_new_tokens, sampling, target.stop_token_ids)
    meta = {
        "sampling": vars(sampling),
        "max_new_tokens": max_new_tokens,
        "target": target.identity(),
        "backend": backend,
    }

    conversations = Conversations(target, queue, meta)
    for r in todo:
        conversations.start(r)

    tokens = written = 0
    start = time.perf_counter()
    bar = tqdm(total=len(todo), desc="regenerate", unit="conv", disable=not progress, dynamic_ncols=True)
    with contextlib.ExitStack() as files:
        f = None  # opened with the first finished record: a run that fails before it leaves no empty file
        for rid, result in answers:
            if max_seconds and time.perf_counter() - start > max_seconds and len(queue):
                conversations.finish_under_way()
            tokens += len(result.token_ids)
            record = conversations.answered(rid, result)
            if record is None:  # its next user turn is queued
                continue
            if f is None:
                out_path.parent.mkdir(parents=True, exist_ok=True)
                f = files.enter_context(out_path.open("a", encoding="utf-8"))
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
            f.flush()
            os.fsync(f.fileno())
            written += 1
            bar.update(1)
            bar.set_postfix(tok_s=f"{tokens / (time.perf_counter() - start):.0f}")
    bar.close()
    seconds = time.perf_counter() - start
    return {
        "records_written": written,
        "records_left": len(todo) - written,
        "skipped_done": len(done),
        "new_tokens": tokens,
        "seconds": round(seconds, 1),
        "tokens_per_s": round(tokens / seconds, 1) if seconds else 0.0,
    }
