"""The engine's measurements: verify cost per batch shape, the per-machine precision choice, the engine benchmark."""

from __future__ import annotations

import json

import torch

from conftest import tiny_drafter, tiny_target


def test_profile_measures_every_batch_shape_on_rows_of_different_lengths(monkeypatch):
    """Every batch shape is timed, on rows of different context lengths as continuous batching makes them (rows
    of one length attend in one call and cost less)."""
    from dspark.kvcache import KVCache
    from dspark.scheduling.profile import profile_target

    lengths = []
    advance = KVCache.advance
    monkeypatch.setattr(KVCache, "advance", lambda self, num_new: (lengths.append(num_new), advance(self, num_new)))
    table = profile_target(tiny_target(), token_counts=(1, 2, 4), context=16, repeats=1, batch_sizes=(1, 2))
    prefills = [n.tolist() for n in lengths if int(n.max()) > 4]
    assert prefills == [[16], [16, 11]]
    assert table.token_counts == [1, 2, 4, 8]  # totals: 1x1, 1x2 = 2x1, 1x4 = 2x2, 2x4
    shapes = {(g["batch_size"], g["tokens_per_row"]) for g in table.meta["grid"]}
    assert shapes == {(1, 1), (1, 2), (1, 4), (2, 1), (2, 2), (2, 4)}
    assert all(g["ms"] > 0 for g in table.meta["grid"])


def test_precision_follows_the_cpu_and_the_measurement(monkeypatch, tmp_path):
    from dspark import autotune as precision

    monkeypatch.setenv("DSPARK_CACHE", str(tmp_path))
    loads = []

    def load(dtype):
        loads.append(dtype)
        return tiny_target(dtype=getattr(torch, dtype))

    monkeypatch.setattr(precision, "cpu_flags", lambda: {"avx2", "fma"})
    choice = precision.choose_precision("tiny", load)
    assert choice.dtype == "float32" and "no native bfloat16" in choice.reason and loads == []  # nothing to measure

    monkeypatch.setattr(precision, "cpu_flags", lambda: {"avx2", "amx_bf16"})
    choice = precision.choose_precision("tiny", load)
    assert loads == ["float32", "bfloat16"] and set(choice.step_ms) == {"float32", "bfloat16"}
    faster = min(choice.step_ms, key=lambda d: choice.step_ms[d]["1"] + choice.step_ms[d]["8"])
    assert choice.dtype == faster and "amx_bf16" in choice.reason
    assert precision.choose_precision("tiny", load) == choice and len(loads) == 2  # cached per machine


def test_engine_bench_reports_every_engine(tiny_run, tmp_path, monkeypatch):
    from dspark.bench.engine import run_engine_bench
    from dspark.bench.report import engine_plot, engine_section
    from dspark.bench.run import machine_info
    from dspark.target import Target

    def transposed(self, repeats=3):  # as on a machine where the transposed few-row form measured faster
        self.decoder.few_rows_transposed = True
        return self

    monkeypatch.setattr("dspark.autotune.choose_product_forms", transposed)
    folder, _ = tiny_run
    target = Target.load(str(folder))
    tiny_drafter(target, block_size=3, mask_token_id=63).save(tmp_path / "drafter", target.identity())
    evalset = tmp_path / "evalset.jsonl"
    evalset.write_text(json.dumps({"turns": ["t5 t9 t30"]}) + "\n")
    run = run_engine_bench(
        str(folder),
        ["float32"],
        tmp_path / "drafter",
        [str(evalset)],
        6,
        counts=(1, 2),
        context=8,
        repeats=1,
        bandwidth_gib=0.01,
        progress=lambda _: None,
    )
    assert run["llama_cpp"] is None  # a local folder ships no GGUF
    engines = {r["engine"] for r in run["forward"]}
    assert engines == {"ours", "ours, F.linear on few rows", "hf", "bandwidth bound"}  # the replaced form beside
    row = run["decode"][0]
    assert row["ours"] > 0 and row["hf"] > 0 and row["dspark identical"] and row["dspark+sched identical"]
    run.update(machine=machine_info(), when="now", command="dspark bench-engine")
    text = engine_section(run, "dspark bench-engine", "engine.png")
    assert "| float32 | ours |" in text and "bandwidth bound" in text and "dspark+sched" in text
    assert engine_plot(run, tmp_path / "engine.png").stat().st_size > 1000


def test_int8_target_is_close_to_float_and_speculation_stays_exact():
    """Weight-only int8: logits near the float model's; plain and speculative decoding of the quantized target agree
    token for token (they share it), under a noisy oracle that gets most drafts accepted."""
    from conftest import NoisyOracle
    from dspark.decoding.engine import SpeculativeEngine
    from dspark.decoding.plain import generate_plain

    exact, quantized = tiny_target(eos=7), tiny_target(eos=7).quantize_int8()
    ids = torch.randint(0, 90, (2, 12))
    a, b = exact.forward_sequences(ids).logits, quantized.forward_sequences(ids).logits
    assert not torch.equal(a, b) and (a - b).abs().max() < 0.05 * a.abs().max()
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() > 0.9
    prompts = [[3, 9, 14], [5], [20, 21, 22, 23, 24]]
    expected = [r.token_ids for r in generate_plain(quantized, prompts, 30)]
    engine = SpeculativeEngine(quantized, NoisyOracle(quantized, prompts, block_size=4, noise=0.2))
    results = engine.generate(prompts, 30)
    assert [r.token_ids for r in results] == expected
    assert sum(r.stats.tokens - r.stats.rounds for r in results) > 20
