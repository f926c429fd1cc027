"""The GPU path (recipes/gpu.sh): regeneration and training on CUDA agree with the CPU. Skipped without a GPU, so CI
(CPU only) never runs them; run them on a GPU machine with `pytest tests/test_gpu.py`."""

from __future__ import annotations

import json

import pytest
import torch

from test_training import tiny_config

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_regeneration_on_the_gpu_writes_what_the_cpu_writes(tiny_run, tmp_path):
    from dspark.records import read_records
    from dspark.target import Target
    from dspark.training.regenerate import regenerate

    folder, data = tiny_run
    prompts = [{"id": r["id"], "messages": r["messages"][:1]} for r in read_records(data)[:12]]
    answers = {}
    for device in ("cpu", "cuda"):
        out = tmp_path / f"{device}.jsonl"
        regenerate(
            Target.load(str(folder), device=device), prompts, out, max_new_tokens=20, batch_size=5, progress=False
        )
        answers[device] = {r["id"]: r["assistant_token_ids"] for r in map(json.loads, out.read_text().splitlines())}
    assert answers["cuda"] == answers["cpu"] and len(answers["cuda"]) == 12


def test_training_on_the_gpu_learns_and_its_checkpoint_decodes_losslessly_on_the_cpu(tiny_run, tmp_path):
    from dspark.decoding.engine import SpeculativeEngine
    from dspark.decoding.plain import generate_plain
    from dspark.drafter import load_drafter
    from dspark.target import Target
    from dspark.training.trainer import train

    folder, data = tiny_run
    train(
        tiny_config(folder, data, tmp_path / "run", max_steps=20, device="cuda", target_dtype="bfloat16", bf16=True),
        progress=False,
    )
    steps = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert steps[-1]["step"] == 20 and steps[-1]["loss"] < steps[0]["loss"]
    assert "cuda" in json.loads((tmp_path / "run" / "checkpoint" / "config.json").read_text())["progress"]["device"]
    target = Target.load(str(folder))
    drafter = load_drafter(tmp_path / "run" / "checkpoint", target)
    prompts = [[1, 7, 9, 3, 1], [1, 44, 3, 1]]
    expected = [r.token_ids for r in generate_plain(target, prompts, 20)]
    assert [r.token_ids for r in SpeculativeEngine(target, drafter).generate(prompts, 20)] == expected
