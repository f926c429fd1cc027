"""Benchmarks: every method side by side, JSON result, BENCHMARKS.md section and plots, on a tiny target folder."""

import json
import sys

import pytest
import torch

from conftest import refused, run_cli, run_cli_output, tiny_drafter
from dspark.bench.report import markdown_section, plots, write_section
from dspark.bench.run import BenchConfig, run_bench
from dspark.drafter.suffix import ANSWER_INDEX, write_answer_index
from dspark.target import Target


@pytest.fixture(scope="module")
def bench_run(tiny_run, tmp_path_factory):
    folder, _ = tiny_run
    tmp = tmp_path_factory.mktemp("bench")
    target = Target.load(str(folder))
    # a drafter continued once (--init-from): the bench must report both legs' training, not only the last
    legs = {
        "lineage": [{"run": "leg1", "steps": 5, "tokens": 100, "core_seconds": 3600, "device": "cpu: test"}],
        "training": {"out": "leg2", "preset": "dspark"},
        "progress": {"step": 3, "tokens": 50, "seconds": 900, "core_seconds": 1800, "device": "cpu: test"},
    }
    tiny_drafter(target, block_size=4, mask_token_id=63).save(tmp / "drafter", target.identity(), extra=legs)
    write_answer_index([[5, 9, 30, 31, 32, 33] * 3, [6, 10, 31, 40, 41]], tmp / "drafter" / ANSWER_INDEX)
    evalset = tmp / "evalset.jsonl"
    evalset.write_text(
        "".join(json.dumps({"turns": [f"t{5 + i} t{9 + i} t{30 + i}", "second turn"]}) + "\n" for i in range(3))
    )
    cfg = BenchConfig(
        model=str(folder),
        datasets=[str(evalset)],
        prompts_per_set=2,
        max_new_tokens=12,
        temperatures=[0.0, 1.0],
        dtypes=["float32"],
        drafters={  # the drafter alone, suffix decoding alone and both (the default for a drafter with an index)
            "dspark": f"no-suffix:{tmp / 'drafter'}",
            "suffix": f"suffix:{tmp / 'drafter'}",
            "dspark+suffix": str(tmp / "drafter"),
        },
        scheduled=True,
    )
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DSPARK_CACHE", str(tmp / "cache"))  # the profiled cost table is cached there, not in ~/.cache
        run = run_bench(cfg, progress=lambda _: None)
    assert list((tmp / "cache" / "costs").glob("*.json"))
    return run, tmp


def test_second_turns_follow_the_plain_first_answer(tiny_run, tmp_path, capsys):
    """The repetitive workload: each record's second turn asked after our greedy answer to its first."""
    from conftest import run_cli
    from dspark.bench.run import bench_prompts
    from dspark.decoding.plain import generate_plain

    folder, _ = tiny_run
    target = Target.load(str(folder))
    evalset = tmp_path / "two.jsonl"
    evalset.write_text(json.dumps({"turns": ["t5 t9", "t30 t31"]}) + "\n" + json.dumps({"turns": ["t7"]}) + "\n")
    cfg = BenchConfig(model=str(folder), datasets=[str(evalset)], prompts_per_set=5, max_new_tokens=6)
    first = target.encode_chat("t5 t9")
    answer = target.tokenizer.decode(generate_plain(target, [first], 6)[0].token_ids, skip_special_tokens=True)
    asked = [
        {"role": "user", "content": "t5 t9"},
        {"role": "assistant", "content": answer},
        {"role": "user", "content": "t30 t31"},
    ]
    cfg.second_turns = True
    assert bench_prompts(target, str(evalset), cfg) == [target.encode_chat(asked)]
    one = tmp_path / "one.jsonl"
    one.write_text(json.dumps({"turns": ["t7"]}) + "\n")
    code, err = run_cli(
        capsys, "bench", "speed", "--model", folder, "--drafter", "s=suffix", "--datasets", one, "--second-turns"
    )
    assert code == 2 and "no record has a second turn" in err


def test_every_method_is_measured_and_greedy_speculation_is_identical(bench_run):
    run, _ = bench_run
    methods = {r["method"] for r in run["results"]}
    spec = {"dspark", "suffix", "dspark+suffix"}
    assert methods == {"plain", "hf", "hf-lookup", *spec, *(f"{m}+sched" for m in spec)}
    for r in run["results"]:
        assert r["tokens"] > 0 and r["tokens_per_s"] > 0 and r["prompts"] == 2
        if r["method"] == "plain":
            assert r["speedup_vs_plain"] == 1.0
        if r["temperature"] == 0:
            # HF generate and our plain decoding agree; speculative decoding is lossless
            assert r["identical_to_plain"] == 2, r
    spec = [r for r in run["results"] if "tau" in r]
    for r in spec:  # τ·rounds counts every token a round produced: all output tokens but each prompt's first, plus at
        # most γ per prompt cut off at the token limit
        produced = round(r["tau"] * r["rounds"])
        assert r["tokens"] - r["prompts"] <= produced <= r["tokens"] - r["prompts"] + 4 * r["prompts"], r
        assert len(r["accept_by_position"]) == 4
    assert all(set(r["ms_per_round"]) == {"draft", "verify", "context", "other"} for r in spec)
    assert run["machine"]["torch"] and run["drafters"]["dspark"]["weights_mb"] > 0
    kinds = {label: (d["architecture"], d["suffix_trees"]) for label, d in run["drafters"].items()}
    assert kinds == {
        "dspark": ("dspark", False),
        "suffix": ("suffix", True),
        "dspark+suffix": ("dspark + suffix", True),
    }
    training = run["drafters"]["dspark"]["training"]
    assert (training["legs"], training["tokens"], training["steps"], training["core_hours"]) == (2, 150, 8, 1.5)
    assert run["target_weights_mb"]["float32"] > 0


def test_report_sections_and_plots(bench_run):
    run, tmp = bench_run
    md = tmp / "BENCHMARKS.md"
    pngs = plots(run, tmp / "plots", "quick")
    assert all(p.exists() and p.stat().st_size > 1000 for p in pngs.values()) and len(pngs) == 3
    write_section(
        md, "quick", markdown_section(run, "quick", "dspark bench --name quick", {k: str(v) for k, v in pngs.items()})
    )
    write_section(md, "full", markdown_section(run, "full", "dspark bench --name full", {}))
    write_section(md, "quick", markdown_section(run, "quick", "dspark bench --name quick --again", {}))
    text = md.read_text()
    assert text.count("<!-- bench:quick:begin -->") == 1 and "--again" in text and "<!-- bench:full:begin -->" in text
    assert "| HF prompt lookup |" in text and "Acceptance by position" in text and "float32, temperature 1.0" in text
    assert "| 2 | 150 | 8 | 1.5 | – |" in text  # the drafter's legs, tokens, steps, core-hours, GPU-hours


def test_bad_drafter_argument_exits_with_a_clear_error(capsys):
    refused(capsys, "LABEL=PATH", "bench", "speed", "--drafter", "nolabel")


def test_training_curves_compare_runs_at_equal_time_and_tokens(tmp_path):
    from dspark.bench.report import curve_at, curves_table, training_curves

    for name, speed in (("a", 1.0), ("b", 2.0)):
        folder = tmp_path / name
        folder.mkdir()
        rows = [
            {"step": s, "seconds": s * 10 / speed, "tokens": s * 100, "tau_greedy": 1 + s / 100} for s in (0, 50, 100)
        ]
        rows.insert(1, {"step": 10, "seconds": 1.0, "tokens": 5})  # a step without evaluation is skipped
        if name == "b":  # b also decoded for real (--decode-eval-every) at step 50
            rows[2]["decode_tau_all"] = 1.7
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
    assert row_b.endswith("| 1.700 (50) |") and next(
        line for line in table.splitlines() if line.startswith("| a |")
    ).endswith("| – |")


def test_curves_command_writes_the_table_and_refuses_a_bad_reference(tmp_path, capsys):
    folder = tmp_path / "run"
    folder.mkdir()
    rows = [{"step": s, "seconds": 10.0 * s, "tokens": 100 * s, "tau_greedy": 1 + s / 100} for s in (100, 200)]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cmd = ["bench", "curves", "--run", f"a={folder}", "--out", tmp_path / "c.png"]
    code, out, err = run_cli_output(capsys, *cmd, "--markdown", tmp_path / "B.md")
    assert code == 0, err
    assert "<!-- bench:training-curves:begin -->" in (tmp_path / "B.md").read_text() and "| a | 200 |" in out
    code, _ = run_cli(capsys, *cmd, "--markdown", tmp_path / "B.md", "--section", "ab", "--title", "A/B")
    text = (tmp_path / "B.md").read_text()
    assert code == 0 and "<!-- bench:ab:begin -->\n## A/B" in text and "bench:training-curves:begin" in text
    refused(capsys, "--reference 'zzz' is not one of the --run labels", *cmd, "--reference", "zzz")
    refused(capsys, "must be a plain name", *cmd, "--section", "a b")


FAKE_LLAMA = """#!{python}
# Stands in for llama.cpp's programs: prints what they print, so the benchmark's parsing and checks are tested.
import sys
args = sys.argv[1:]
if "--version" in args:
    sys.exit(print("version: 1 (fake)", file=sys.stderr))
prompt = args[args.index("-p") + 1]
if sys.argv[0].endswith("llama-completion"):
    print("hello world [end of text]")
    print("common_perf_print: prompt eval time =      37.50 ms /     5 tokens", file=sys.stderr)
    print("common_perf_print:        eval time =     100.00 ms /    10 runs", file=sys.stderr)
else:
    p_min = args[args.index("--spec-draft-p-min") + 1] if "--spec-draft-p-min" in args else None
    print(prompt + ("hello there" if p_min == "0.5" else "hello world"))
    print("encoded    5 tokens in   0.025 seconds", file=sys.stderr)
    print("decoded   10 tokens in   0.225 seconds", file=sys.stderr)
    print("n_accept  = " + ("0" if p_min is None else "5"), file=sys.stderr)
"""


def test_llama_cpp_bench_reads_llama_cpp_and_reports_each_runtime(bench_run, tmp_path):
    from dspark.bench.llamacpp import run_llama_cpp_bench
    from dspark.bench.report import llama_cpp_plot, llama_cpp_section
    from dspark.drafter import load_drafter

    _, tmp = bench_run
    for tool in ("llama-completion", "llama-speculative-simple"):
        (tmp_path / tool).write_text(FAKE_LLAMA.format(python=sys.executable))
        (tmp_path / tool).chmod(0o755)
    target = Target.load(json.loads((tmp / "drafter" / "config.json").read_text())["target"]["name_or_path"])
    drafter = load_drafter(tmp / "drafter", target)
    evalset = tmp / "evalset.jsonl"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DSPARK_CACHE", str(tmp / "cache"))
        run = run_llama_cpp_bench(
            target,
            drafter,
            tmp / "drafter",
            tmp_path / "draft.gguf",
            {"Q4_1": tmp_path / "t.gguf", "float32": tmp_path / "t.f32.gguf"},
            tmp_path,
            [str(evalset)],
            2,
            8,
            0.5,
            1,
            progress=lambda _: None,
        )
    row = run["rows"][0]["runtimes"]
    assert list(row) == ["ours float32", "llama.cpp Q4_1", "llama.cpp float32"]
    llama = row["llama.cpp Q4_1"]
    # 11 tokens in 37.5 + 100 ms, 10 in 25 + 225 ms: timed from the prompt, as ours
    assert llama["plain"]["tok_s"] == 80.0 and not llama["plain"]["same_as_ours"]  # the fake says "hello world"
    assert llama["ngram"] == {"tok_s": 40.0, "tau": 1.0, "identical": True}
    assert llama["dspark"] == {"tok_s": 40.0, "tau": 2.0, "identical": True}  # 10 tokens, 5 drafts accepted
    assert llama["dspark p>=0.5"]["identical"] is False  # "hello there" is not the plain output
    assert all(row["ours float32"][m]["identical"] for m in ("dspark", "dspark+sched"))

    run.update(machine={"cpu": "fake", "cores": 1, "torch_threads": 1}, when="now")
    text = llama_cpp_section(run, "dspark bench-llama-cpp", "llama-cpp.png")
    assert "| **all** | 80.00 | 40.00 (τ 1.00) | 40.00 (τ 2.00) | 40.00 (τ 2.00) | 0.50x |" in text
    assert "llama.cpp Q4_1 dspark p>=0.5: NO" in text and "llama.cpp float32: 0 of 2 prompts" in text
    assert llama_cpp_plot(run, tmp_path / "llama-cpp.png").stat().st_size > 0


# ---- bench-signal: teacher-forced acceptance against real decoding ---------------------------------------------------
@pytest.fixture(scope="module")
def trained_tiny_drafter(tiny_run, tmp_path_factory):
    """A tiny drafter trained for 20 steps: it accepts 0, 1 and 2 drafts in a round, so every path of a walk runs."""
    from dspark.training.trainer import train
    from test_training import tiny_config

    folder, data = tiny_run
    run = tmp_path_factory.mktemp("signal") / "run"
    train(tiny_config(folder, data, run, max_steps=20, save_every=20), progress=False)
    return folder, data, run / "checkpoint"


def test_teacher_forcing_along_the_rounds_is_real_decoding(trained_tiny_drafter):
    """Training's view of the drafter (the training forward on finished text) at the anchors decoding visits gives,
    round by round, what the engine accepted: the check that training and inference see the same drafter."""
    from dspark.bench.signal import along_rounds, every_position, score_answer
    from dspark.decoding.engine import SpeculativeEngine
    from dspark.decoding.policy import FixedLength
    from dspark.drafter import load_drafter
    from dspark.records import Example

    folder, _, checkpoint = trained_tiny_drafter
    target = Target.load(str(folder))
    drafter = load_drafter(checkpoint, target).eval()
    prompts = [[1, 7, 9, 3, 1], [1, 44, 3, 1], [1, 12, 50, 3, 1]]
    results = SpeculativeEngine(target, drafter, FixedLength()).generate(prompts, 30, stop_token_ids=set())
    seen = set()
    for prompt, result in zip(prompts, results):
        answer = Example(prompt + result.token_ids, [0] * len(prompt) + [1] * len(result.token_ids))
        scored = score_answer(drafter, target, answer)
        walked = along_rounds([scored], drafter.block_size)
        # the prefill says the first of the 30 tokens; the rounds the other 29
        assert walked.accepted_hist == result.stats.accepted_hist and walked.tokens == result.stats.tokens == 29
        seen |= {k for k, n in enumerate(walked.accepted_hist) if n}
        # every position: one anchor per answer token with a whole block after it
        assert every_position([scored], drafter.block_size).rounds == 30 - drafter.block_size
    assert {0, 1, 2} <= seen


def test_training_walks_the_rounds_decoding_would_take(trained_tiny_drafter, tmp_path):
    """The trainer's held-out tau_rounds is the along-rounds τ of bench-signal (which equals real decoding, above), and
    --rollout-anchors 1 anchors every block where those rounds start."""
    from dspark.bench.signal import along_rounds, score_answer
    from dspark.drafter import load_drafter
    from dspark.training.anchors import leading_runs, visited_anchors
    from dspark.training.batches import anchor_generator, load_examples, plan_blocks
    from dspark.training.evaluation import evaluate
    from dspark.training.features import OnlineFeatures
    from dspark.training.trainer import train
    from test_training import tiny_config

    folder, data, checkpoint = trained_tiny_drafter
    cfg = tiny_config(folder, data, tmp_path / "run", rollout_anchors=1.0, num_anchors=4)
    target = Target.load(str(folder), dtype="float32", layer_ids=cfg.target_layer_ids)  # as the trainer loads it
    drafter = load_drafter(checkpoint, target).float()
    examples = load_examples(target, cfg.data, cfg.max_length, cfg.holdout)[0][:6]
    walked = along_rounds([score_answer(drafter, target, e) for e in examples], drafter.block_size)
    assert evaluate(drafter, OnlineFeatures(target, 0), examples, cfg, batch_size=4)["tau_rounds"] == round(
        walked.tau, 4
    )

    batch = OnlineFeatures(target, 0)(examples[:4])
    plan = plan_blocks(batch, cfg, anchor_generator(0, 0, 0), drafter)
    visited = visited_anchors(
        leading_runs(drafter, batch.features, batch.input_ids, batch.loss_mask), batch.loss_mask, drafter.block_size
    )
    chosen = plan.supervised.any(-1)
    assert visited.sum(1).min() >= 4 and visited.gather(1, plan.anchors)[chosen].all()
    train(cfg, progress=False)  # and the loop runs with it
    assert (tmp_path / "run" / "checkpoint").exists()


def test_bench_signal_cli_reports_every_slice(trained_tiny_drafter, tmp_path, capsys):
    from conftest import run_cli

    folder, data, checkpoint = trained_tiny_drafter
    evalset = tmp_path / "evalset.jsonl"
    evalset.write_text("".join(json.dumps({"turns": [f"t{5 + i} t{9 + i} t{30 + i}"]}) + "\n" for i in range(3)))
    signal = ["bench", "signal", "--model", folder, "--dtype", "float32", "--drafter", checkpoint, "--data", data]
    signal += ["--examples", 4, "--datasets", evalset]
    code, err = run_cli(
        capsys,
        *signal,
        "--holdout",
        0.1,
        "--prompts-per-set",
        2,
        "--max-new-tokens",
        16,
        "--out",
        tmp_path / "out",
        "--markdown",
        tmp_path / "B.md",
    )
    assert code == 0, err
    run = json.loads((tmp_path / "out" / "signal.json").read_text())
    rows = {r["slice"]: r for r in run["rows"]}
    assert set(rows) == {"train", "held-out", "evalset"}
    assert rows["evalset"]["rounds_tau"] == rows["evalset"]["real_tau"] and rows["evalset"]["real_rounds"] > 0
    assert all(rows[s]["anchors"] > 0 and 1 <= rows[s]["tf_tau"] <= 5 for s in rows)
    md = (tmp_path / "B.md").read_text()
    assert "## signal: training signal by position" in md and "| evalset | target's answers |" in md
    assert (tmp_path / "out" / "signal.png").stat().st_size > 0
    assert all(0 < rows[s]["target_p_mean"] <= 1 and 0 <= rows[s]["target_p_below_half"] <= 1 for s in rows)
    assert f"| {rows['evalset']['target_p_mean']:.2f} ({rows['evalset']['target_p_below_half']:.2f}) |" in md
    assert run["training"]["legs"] == 1 and run["training"]["tokens"] > 0 and run["training"]["steps"] == 20
    # a run trained with --holdout 0 has no held-out slice: measured without it
    code, err = run_cli(
        capsys, *signal, "--holdout", 0, "--prompts-per-set", 1, "--max-new-tokens", 8, "--out", tmp_path / "zero"
    )
    assert code == 0, err
    assert {r["slice"] for r in json.loads((tmp_path / "zero" / "signal.json").read_text())["rows"]} == {
        "train",
        "evalset",
    }
    refused(
        capsys,
        "--holdout is a share",
        "bench",
        "signal",
        "--model",
        folder,
        "--dtype",
        "float32",
        "--drafter",
        checkpoint,
        "--holdout",
        1.5,
    )


def test_signal_reads_the_targets_confidence_in_its_own_greedy_tokens(trained_tiny_drafter):
    """On the target's own greedy answer every next token is its argmax: the probability the signal reports at each
    anchor must be the largest of the target's softmax there."""
    from dspark.bench.signal import score_answer
    from dspark.decoding.plain import generate_plain
    from dspark.drafter import load_drafter
    from dspark.records import Example
    from dspark.target import Target

    folder, _, checkpoint = trained_tiny_drafter
    target = Target.load(str(folder), dtype="float32")
    drafter = load_drafter(checkpoint, target).float()
    prompt = [1, 7, 9, 3, 1]
    answer = generate_plain(target, [prompt], 12, stop_token_ids=set())[0].token_ids
    ids = prompt + answer
    scored = score_answer(drafter, target, Example(ids, [0] * len(prompt) + [1] * len(answer)))
    probs = target.forward_sequences(torch.tensor([ids])).logits[0].softmax(-1)
    assert len(scored.target_p) > 0
    assert torch.allclose(scored.target_p, probs[scored.anchors].max(-1).values, atol=1e-5)


# ---- scaling: real τ of a drafter's legs against its cumulative compute ---------------------------------------------
def test_scaling_fits_real_tau_against_tokens_and_extrapolates_to_the_goal(tmp_path, capsys):
    """Three legs on an exact power law τ − 1 = 0.4 · (T / 1M)^0.5: the fit must give the exponent back and put
    τ = 3 at T = 25M tokens, and at the last leg's 1M tokens per core-hour the 21M still to train at 21 core-hours."""
    from conftest import run_cli

    signals = []
    for tokens in (1_000_000, 2_000_000, 4_000_000):
        tau = 1 + 0.4 * (tokens / 1e6) ** 0.5
        run = {
            "drafter": f"runs/{tokens}",
            "training": {
                "legs": 1,
                "tokens": tokens,
                "core_hours": tokens / 1e6,
                "last_leg": {"tokens": tokens, "core_seconds": tokens * 3.6e-3},
            },
            "rows": [
                {"slice": "held-out", "tf_tau": 2.0},
                {"slice": "gsm8k", "real_tau": tau},
                {"slice": "mt-bench", "real_tau": tau},
            ],
        }
        signals.append(tmp_path / f"leg{len(signals)}.json")
        signals[-1].write_text(json.dumps(run))
    code, err = run_cli(
        capsys,
        "bench",
        "scaling",
        "--signal",
        *signals,
        "--goal",
        "3",
        "mt-bench=1.8",
        "--out",
        tmp_path / "out",
        "--markdown",
        tmp_path / "B.md",
    )
    assert code == 0, err
    rows = {r["set"]: r for r in json.loads((tmp_path / "out" / "scaling.json").read_text())["rows"]}
    assert set(rows) == {"gsm8k", "mt-bench", "mean"}
    assert rows["mean"]["exponent"] == pytest.approx(0.5, abs=1e-3)
    assert rows["mean"]["tokens_for_goal"] == pytest.approx(25e6, rel=1e-3)
    assert rows["mean"]["times_now"] == pytest.approx(6.25, abs=0.06)
    assert rows["mean"]["hours_more"] == pytest.approx(21.0, abs=0.1) and rows["mean"]["hour"] == "core-hour"
    assert rows["mt-bench"]["goal"] == 1.8 and rows["mt-bench"]["tokens_for_goal"] == pytest.approx(4e6, rel=1e-3)
    md = (tmp_path / "B.md").read_text()
    assert (
        "## scaling: real τ against cumulative training compute" in md
        and "| mean | 1.40 → 1.57 → 1.80 | 0.50 | 3 | 25M |" in md
    )
    assert (tmp_path / "out" / "scaling.png").stat().st_size > 0
    last = json.loads(signals[-1].read_text())  # the last leg on a GPU: the hours still to train are GPU-hours
    last["training"]["last_leg"]["device"] = "cuda: NVIDIA H200"
    signals[-1].write_text(json.dumps(last))
    assert (
        run_cli(
            capsys, "bench", "scaling", "--signal", *signals, "--out", tmp_path / "out", "--markdown", tmp_path / "B.md"
        )[0]
        == 0
    )
    rows = {r["set"]: r for r in json.loads((tmp_path / "out" / "scaling.json").read_text())["rows"]}
    assert rows["mean"]["hour"] == "GPU-hour" and rows["mean"]["hours_more"] == pytest.approx(21.0, abs=0.1)
    assert "| GPU-hours more |" in (tmp_path / "B.md").read_text()
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"rows": [{"slice": "gsm8k", "real_tau": 1.5}]}))
    refused(
        capsys, "no training totals of its drafter", "bench", "scaling", "--signal", old, signals[0], "--out", tmp_path
    )
    refused(capsys, "at least two drafters", "bench", "scaling", "--signal", signals[0], signals[0], "--out", tmp_path)
    refused(
        capsys,
        "a goal is a τ above 1",
        "bench",
        "scaling",
        "--signal",
        *signals,
        "--goal",
        "mt-bench=x",
        "--out",
        tmp_path,
    )
