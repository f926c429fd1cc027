"""Benchmarks: every method side by side, JSON result, BENCHMARKS.md section and plots, on a tiny target folder."""

import json
import subprocess
import sys

import pytest

from conftest import tiny_drafter
from dspark.bench.report import markdown_section, plots, write_section
from dspark.bench.run import BenchConfig, run_bench
from dspark.target import Target


@pytest.fixture(scope="module")
def bench_run(tiny_run, tmp_path_factory):
    folder, _ = tiny_run
    tmp = tmp_path_factory.mktemp("bench")
    target = Target.load(str(folder))
    tiny_drafter(target, block_size=4, mask_token_id=63).save(tmp / "drafter", target.identity())
    evalset = tmp / "evalset.jsonl"
    evalset.write_text("".join(json.dumps({"turns": [f"t{5 + i} t{9 + i} t{30 + i}", "second turn"]}) + "\n" for i in range(3)))
    cfg = BenchConfig(model=str(folder), datasets=[str(evalset)], prompts_per_set=2, max_new_tokens=12,
                      temperatures=[0.0, 1.0], dtypes=["float32"], drafters={"dspark": str(tmp / "drafter")},
                      scheduled=True)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DSPARK_CACHE", str(tmp / "cache"))  # the profiled cost table is cached there, not in ~/.cache
        run = run_bench(cfg, progress=lambda _: None)
    assert list((tmp / "cache" / "costs").glob("*.json"))
    return run, tmp


def test_every_method_is_measured_and_greedy_speculation_is_identical(bench_run):
    run, _ = bench_run
    methods = {r["method"] for r in run["results"]}
    assert methods == {"plain", "hf", "hf-lookup", "dspark", "dspark+sched"}
    for r in run["results"]:
        assert r["tokens"] > 0 and r["tokens_per_s"] > 0 and r["prompts"] == 2
        if r["method"] == "plain":
            assert r["speedup_vs_plain"] == 1.0
        if r["temperature"] == 0:
            # HF generate and our plain decoding agree; speculative decoding is lossless
            assert r["identical_to_plain"] == 2, r
    spec = [r for r in run["results"] if r["method"].startswith("dspark")]
    for r in spec:  # τ·rounds counts every token a round produced: all output tokens but each prompt's first, plus at
        # most γ per prompt cut off at the token limit
        produced = round(r["tau"] * r["rounds"])
        assert r["tokens"] - r["prompts"] <= produced <= r["tokens"] - r["prompts"] + 4 * r["prompts"], r
        assert len(r["accept_by_position"]) == 4
    assert all(set(r["ms_per_round"]) == {"draft", "verify", "context", "other"} for r in spec)
    assert run["machine"]["torch"] and run["drafters"]["dspark"]["weights_mb"] > 0
    assert run["target_weights_mb"]["float32"] > 0


def test_report_sections_and_plots(bench_run):
    run, tmp = bench_run
    md = tmp / "BENCHMARKS.md"
    pngs = plots(run, tmp / "plots", "quick")
    assert all(p.exists() and p.stat().st_size > 1000 for p in pngs.values()) and len(pngs) == 3
    write_section(md, "quick", markdown_section(run, "quick", "dspark bench --name quick", {k: str(v) for k, v in pngs.items()}))
    write_section(md, "full", markdown_section(run, "full", "dspark bench --name full", {}))
    write_section(md, "quick", markdown_section(run, "quick", "dspark bench --name quick --again", {}))
    text = md.read_text()
    assert text.count("<!-- bench:quick:begin -->") == 1 and "--again" in text and "<!-- bench:full:begin -->" in text
    assert "| HF prompt lookup |" in text and "Acceptance by position" in text and "float32, temperature 1.0" in text


def test_bad_drafter_argument_exits_with_a_clear_error():
    proc = subprocess.run([sys.executable, "-m", "dspark.cli", "bench", "--drafter", "nolabel"],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and "LABEL=PATH" in proc.stderr


def test_training_curves_compare_runs_at_equal_time_and_tokens(tmp_path):
    from dspark.bench.report import curve_at, curves_table, training_curves

    for name, speed in (("a", 1.0), ("b", 2.0)):
        folder = tmp_path / name
        folder.mkdir()
        rows = [{"step": s, "seconds": s * 10 / speed, "tokens": s * 100, "tau_greedy": 1 + s / 100} for s in (0, 50, 100)]
        rows.insert(1, {"step": 10, "seconds": 1.0, "tokens": 5})  # a step without evaluation is skipped
        (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    curves = training_curves({"a": tmp_path / "a", "b": tmp_path / "b"}, tmp_path / "c.png")
    assert (tmp_path / "c.png").stat().st_size > 1000 and len(curves["a"]) == 3
    # b runs twice as fast: at a's final time (1000 s) b is beyond its run; at 500 s b has reached step 100
    assert curve_at(curves["b"], "seconds", 500) == pytest.approx(2.0)
    assert curve_at(curves["a"], "tokens", 2500) == pytest.approx(1.25)
    assert curve_at(curves["b"], "seconds", 5000) is None
    # the table compares at the furthest common point: 10,000 tokens (both), 500 s (b's end)
    table = curves_table(curves, "a", "dspark curves ...", "c.png")
    row_b = next(line for line in table.splitlines() if line.startswith("| b |"))
    assert "10k tokens" in table and "| b | 100 | 2.000 | 1.000 | 2.000 | 0.750 |" in row_b


def test_curves_command_writes_the_table_and_refuses_a_bad_reference(tmp_path):
    folder = tmp_path / "run"
    folder.mkdir()
    rows = [{"step": s, "seconds": 10.0 * s, "tokens": 100 * s, "tau_greedy": 1 + s / 100} for s in (100, 200)]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cmd = [sys.executable, "-m", "dspark.cli", "curves", "--run", f"a={folder}", "--out", str(tmp_path / "c.png")]
    proc = subprocess.run(cmd + ["--markdown", str(tmp_path / "B.md")], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "<!-- bench:training-curves:begin -->" in (tmp_path / "B.md").read_text() and "| a | 200 |" in proc.stdout
    proc = subprocess.run(cmd + ["--reference", "zzz"], capture_output=True, text=True)
    assert proc.returncode == 2 and "--reference 'zzz' is not one of the --run labels" in proc.stderr
