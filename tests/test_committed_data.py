"""The regenerated data committed in data/ is what recipes train on: it must stay free of evaluation prompts and of
the calibration prompts (calibration must see text the drafter was not trained on), join into one training file
without id clashes, and belong to the shipped target."""

import json
from pathlib import Path

from dspark.assets import EVAL_DIR
from dspark.fsutil import read_jsonl
from dspark.training.sources import eval_shingles, overlaps

ROOT = Path(__file__).resolve().parents[1]
DRAFTER_CONFIG = ROOT / "src/dspark/data/drafters/smollm2-135m-instruct/config.json"
CALIBRATION_PROMPTS = ROOT / "data/calibration-prompts.jsonl"


def committed_records():
    files = sorted((ROOT / "data").glob("smollm2-135m-instruct-regen*.jsonl.gz"))
    assert len(files) >= 5, files
    for path in files:
        for record in read_jsonl(path):
            yield path.name, record


def test_committed_data_is_clean_and_joins_into_one_file():
    forbidden = eval_shingles(EVAL_DIR)
    calibration = {record["messages"][0]["content"] for record in read_jsonl(CALIBRATION_PROMPTS)}
    fingerprint = json.loads(DRAFTER_CONFIG.read_text())["target"]["fingerprint"]
    seen: dict[str, str] = {}
    for name, record in committed_records():
        assert record["id"] not in seen, f"{record['id']} in both {seen[record['id']]} and {name}"
        seen[record["id"]] = name
        users = [m["content"] for m in record["messages"] if m["role"] == "user"]
        answers = [m for m in record["messages"] if m["role"] == "assistant"]
        assert not any(overlaps(u, forbidden) for u in users), f"{name}: {record['id']} overlaps an evaluation set"
        assert users[0] not in calibration, f"{name}: {record['id']} is a calibration prompt"
        assert len(record["assistant_token_ids"]) == len(answers) >= 1, record["id"]
        assert all(ids for ids in record["assistant_token_ids"]), record["id"]
        assert record["target"]["fingerprint"] == fingerprint, f"{name}: answered by another target"
    assert len(seen) > 4197  # the four sets leg 5 trained on plus the fifth
