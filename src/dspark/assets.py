"""What ships inside the package: the evaluation sets and the drafters trained for known targets."""

from __future__ import annotations

from pathlib import Path

from dspark.errors import DSparkError
from dspark.fsutil import read_jsonl

DATA = Path(__file__).resolve().parent / "data"
EVAL_DIR = DATA / "eval"
SHIPPED_DRAFTERS = {"smollm2-135m-instruct": DATA / "drafters" / "smollm2-135m-instruct"}
EVAL_SETS = ("humaneval", "gsm8k", "mt-bench", "mbpp", "math500")


def eval_path(name_or_path: str) -> Path:
    """An evaluation set by name (shipped copy) or a JSONL path of {"turns": [...]} records."""
    path = EVAL_DIR / f"{name_or_path}.jsonl"
    if path.is_file():
        return path
    path = Path(name_or_path)
    if path.is_file():
        return path
    raise DSparkError(f"unknown evaluation set '{name_or_path}': use one of {', '.join(EVAL_SETS)} or a JSONL path")


def eval_prompts(name_or_path: str, count: int, offset: int = 0) -> list[str]:
    """First user turn of `count` records (the paper's protocol)."""
    path = eval_path(name_or_path)
    records = read_jsonl(path)[offset : offset + count]
    for r in records:
        turns = r.get("turns")
        if not isinstance(turns, list) or not turns or not isinstance(turns[0], str):
            raise DSparkError(f"{path}: every record needs 'turns', a list of prompt strings")
    return [r["turns"][0] for r in records]


def eval_conversations(name_or_path: str, count: int) -> list[list[str]]:
    """Every user turn of the first `count` records that have more than one (MT-Bench's second turns ask to rewrite
    or extend the first answer: text that repeats)."""
    path = eval_path(name_or_path)
    records = [r for r in read_jsonl(path) if isinstance(r.get("turns"), list) and len(r["turns"]) > 1]
    if not records:
        raise DSparkError(f"{path}: no record has a second turn ('turns' with two or more prompts)")
    return [[str(t) for t in r["turns"]] for r in records[:count]]


def shipped_drafter(model: str) -> Path:
    path = SHIPPED_DRAFTERS.get(model)
    if path is None or not (path / "model.safetensors").is_file():
        raise DSparkError(f"no drafter ships for '{model}'; pass --drafter PATH (train one with `dspark train`)")
    return path
