"""Training: anchors, each loss term by hand, the loop (loss falls, exact resume, DDP), data validation,
resumable regeneration."""

import ctypes
import gzip
import json
import math
import os
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import tiny_target
from dspark.errors import DSparkError
from dspark.records import examples_from_record, read_records
from dspark.training import regenerate as regen_mod
from dspark.training.anchors import (
    answer_spans,
    block_supervision,
    decoding_rounds,
    position_weights,
    sample_anchors,
    visited_anchors,
)
from dspark.training.loss import LossWeights, TargetDist, dspark_loss, l1_distance


# ---- anchors ------------------------------------------------------------------------------------------------------
def test_anchors_lie_where_anchor_and_next_token_are_in_the_mask():
    mask = torch.tensor([[0, 0, 1, 1, 1, 0, 1, 1, 0, 0]])
    anchors, valid = sample_anchors(mask, 10, torch.Generator().manual_seed(0))
    assert sorted(anchors[valid].tolist()) == [2, 3, 6]
    assert anchors[valid].tolist() == sorted(anchors[valid].tolist())
    few, valid_few = sample_anchors(mask, 2, torch.Generator().manual_seed(0))
    assert few.shape == (1, 2) and valid_few.all() and set(few[0].tolist()) <= {2, 3, 6}


def test_preferred_anchors_fill_their_quota_first_and_a_zero_share_changes_nothing():
    mask = torch.tensor([[0] + [1] * 20 + [0]] * 2)
    preferred = torch.zeros(2, 22, dtype=torch.bool)
    preferred[0, [3, 7, 11]] = True  # fewer than the quota: all of them, the rest uniform
    preferred[1, 1:21:2] = True  # more than the quota: exactly the quota
    plain = sample_anchors(mask, 8, torch.Generator().manual_seed(5))
    unshared = sample_anchors(mask, 8, torch.Generator().manual_seed(5), preferred, 0.0)
    assert all(torch.equal(a, b) for a, b in zip(plain, unshared))
    anchors, valid = sample_anchors(mask, 8, torch.Generator().manual_seed(5), preferred, 0.5)
    assert valid.all() and anchors.shape == (2, 8)
    assert {3, 7, 11} <= set(anchors[0].tolist())
    assert int(preferred[1][anchors[1]].sum()) >= 4  # the quota, plus any the uniform rest happens to draw
    assert int(preferred[1][sample_anchors(mask, 8, torch.Generator().manual_seed(5), preferred, 1.0)[0][1]].sum()) == 8


def test_decoding_rounds_walk_one_past_each_accepted_run():
    runs = {10: 2, 13: 0, 14: 6, 19: 3}
    # answer 10..21, γ = 4: the prefill says token 10; each anchor is one past the last accepted draft (a run of 6
    # accepts only γ); the last round verifies only what is left before the end
    assert decoding_rounds(10, 12, 4, runs.__getitem__) == [(10, 4, 2), (13, 4, 0), (14, 4, 4), (19, 1, 1)]
    assert decoding_rounds(5, 1, 4, runs.__getitem__) == []
    assert answer_spans(torch.tensor([0, 1, 1, 0, 0, 1, 1, 1])) == [(1, 2), (5, 3)]
    run_rows = torch.tensor([[-1, 3, 0, 0, 0, 0, 1, 1, 0, -1]])
    visited = visited_anchors(run_rows, torch.tensor([[0, 1, 1, 1, 1, 1, 1, 1, 1, 1]]), 3)
    assert visited[0].nonzero()[:, 0].tolist() == [1, 5, 6, 8]


def test_block_supervision_is_the_contiguous_in_mask_prefix():
    mask = torch.tensor([[0, 1, 1, 1, 0, 1, 1]])
    sup = block_supervision(mask, torch.tensor([[1, 5]]), torch.tensor([[True, True]]), block_size=4)
    assert sup[0, 0].tolist() == [True, True, False, False]  # labels 2, 3 in mask; 4 is not, so 5 is cut too
    assert sup[0, 1].tolist() == [True, False, False, False]  # label 6 in mask, 7 is past the end


def test_position_weights():
    assert torch.allclose(position_weights(3, 4.0), torch.tensor([1.0, math.exp(-0.25), math.exp(-0.5)]))
    assert torch.equal(position_weights(3, 0.0), torch.ones(3))


# ---- loss terms by hand -------------------------------------------------------------------------------------------
def test_each_loss_term_by_hand():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2], [0.1, 0.1, 0.8]]))
    q = torch.tensor([[0.4, 0.4, 0.2], [0.0, 0.5, 0.5]])
    labels = torch.tensor([1, 2])
    conf = torch.tensor([0.0, 2.0])
    w = torch.tensor([1.0, math.exp(-0.25)])
    loss, m = dspark_loss(logits, labels, conf, w, TargetDist(q), LossWeights(0.1, 0.9, 1.0))
    ce = [-math.log(0.3), -math.log(0.8)]
    l1 = [0.1 + 0.1 + 0.0, 0.1 + 0.4 + 0.3]
    c_star = [1 - l / 2 for l in l1]
    sig = [0.5, 1 / (1 + math.exp(-2))]
    bce = [-(c * math.log(s) + (1 - c) * math.log(1 - s)) for c, s in zip(c_star, sig)]
    mean = lambda xs: sum(x * float(wi) for x, wi in zip(xs, w)) / float(w.sum())
    assert m["ce"] == pytest.approx(mean(ce), rel=1e-5)
    assert m["tv"] == pytest.approx(mean(l1), rel=1e-5)
    assert m["conf"] == pytest.approx(mean(bce), rel=1e-5)
    assert float(loss) == pytest.approx(0.1 * mean(ce) + 0.9 * mean(l1) + mean(bce), rel=1e-5)


def test_masked_positions_carry_no_loss():
    logits = torch.randn(3, 5)
    q = torch.softmax(torch.randn(3, 5), -1)
    w = torch.tensor([1.0, 0.0, 0.5])
    full, _ = dspark_loss(logits, torch.tensor([0, 1, 2]), None, w, TargetDist(q), LossWeights())
    logits2 = logits.clone()
    logits2[1] = torch.randn(5) * 10
    other, _ = dspark_loss(logits2, torch.tensor([0, 4, 2]), None, w, TargetDist(q), LossWeights())
    assert float(full) == pytest.approx(float(other))


def test_topk_l1_equals_dense_when_the_rest_is_disjoint_and_upper_bounds_it():
    p = torch.tensor([[0.6, 0.3, 0.1, 0.0, 0.0]])
    q = torch.tensor([[0.5, 0.2, 0.0, 0.2, 0.1]])
    dense = l1_distance(p, TargetDist(q), None, None)
    top2 = l1_distance(p, TargetDist(torch.tensor([[0.5, 0.2]]), torch.tensor([[0, 1]])), None, None)
    assert float(top2) == pytest.approx(float(dense))  # p's rest {2} and q's rest {3, 4} are disjoint
    q_overlap = torch.tensor([[0.5, 0.2, 0.3, 0.0, 0.0]])
    exact = l1_distance(p, TargetDist(q_overlap), None, None)
    bound = l1_distance(p, TargetDist(torch.tensor([[0.5, 0.2]]), torch.tensor([[0, 1]])), None, None)
    assert float(bound) >= float(exact) - 1e-6


def test_reduced_vocab_counts_unreachable_target_mass():
    d2t = torch.tensor([0, 2])
    t2d = torch.tensor([0, -1, 1, -1])
    p = torch.tensor([[0.7, 0.3]])  # over draft ids (target ids 0 and 2)
    q = torch.tensor([[0.5, 0.25, 0.25, 0.0]])
    expected = abs(0.7 - 0.5) + abs(0.3 - 0.25) + 0.25  # target id 1 can never be drafted
    assert float(l1_distance(p, TargetDist(q), d2t, t2d)) == pytest.approx(expected)
    sparse = TargetDist(torch.tensor([[0.5, 0.25, 0.25]]), torch.tensor([[0, 1, 2]]))
    assert float(l1_distance(p, sparse, d2t, t2d)) == pytest.approx(expected)


# ---- data ---------------------------------------------------------------------------------------------------------
def write_jsonl(path: Path, rows) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


@pytest.mark.parametrize(
    "bad, message",
    [
        ('{"messages": [{"role": "user", "content": "hi"}]', "not valid JSON"),
        ({"messages": [{"role": "robot", "content": "hi"}]}, "unknown role 'robot'"),
        ({"messages": [{"role": "user", "content": "  "}]}, "empty"),
        ({"text": "hi"}, "needs 'messages'"),
        ({"messages": [{"role": "assistant", "content": "hi"}]}, "no user message"),
    ],
)
def test_bad_lines_are_reported_with_file_and_line(tmp_path, bad, message):
    good = {"messages": [{"role": "user", "content": "hello"}]}
    path = write_jsonl(tmp_path / "d.jsonl", [good, good, bad])
    with pytest.raises(DSparkError, match=f"d.jsonl:3: .*{message}"):
        read_records(path)


@pytest.mark.slow
def test_prompt_mix_covers_what_users_ask_and_never_overlaps_the_evaluation_sets():
    from dspark.cli.args import default_eval_dir
    from dspark.training.sources import MIX, _shingles, build_prompts, eval_shingles

    records, report = build_prompts(600, 0, default_eval_dir())
    shares = {s: n / len(records) for s, n in report["counts"].items()}
    assert all(abs(shares[s] - MIX[s]) < 0.03 for s in MIX), shares
    assist = [r for r in records if r["source"] == "assist"]
    firsts = [r["messages"][0]["content"] for r in assist]
    for marker in ("Read the notes below", "Stay in character", "Write a ", " is the ", "In "):  # MT-Bench's kinds
        assert any(marker in t for t in firsts), marker
    assert 0.3 < sum(len(r["messages"]) == 2 for r in assist) / len(assist) < 0.7  # follow-up turns
    forbidden = eval_shingles(default_eval_dir())
    assert not any(_shingles(m["content"]) & forbidden for r in records for m in r["messages"])
    # nothing that differs between processes (a default's repr holds its memory address)
    assert not any(re.search(r" at 0x[0-9a-f]+>", m["content"]) for r in records for m in r["messages"])
    # ids are digests of the prompt: another seed or mix never gives an id to a different prompt
    other, _ = build_prompts(600, 1, default_eval_dir(), {"assist": 0.5, "math": 0.5})
    mine = {r["id"]: r["messages"] for r in records}
    assert len(mine) == len(records)
    assert all(mine[r["id"]] == r["messages"] for r in other if r["id"] in mine)
    # a mix of one source gives only that source (a source left out is asked for none, not for all it has)
    only, report = build_prompts(50, 2, default_eval_dir(), {"assist": 1.0})
    assert {r["source"] for r in only} == {"assist"} and report["counts"]["code"] == 0
    with pytest.raises(DSparkError, match="unknown prompt source"):
        build_prompts(10, 0, default_eval_dir(), {"poetry": 1.0})


@pytest.mark.slow
def test_the_target_writes_user_requests_of_its_own_and_only_finished_new_clean_ones_are_kept(
    real_target, capsys, tmp_path
):
    from conftest import run_cli
    from dspark.cli.args import default_eval_dir
    from dspark.training.self_prompts import rejection, write_user_turns
    from dspark.training.sources import build_prompts, eval_shingles

    opening, closing = real_target.user_turn_template()
    text = real_target.tokenizer.decode(opening)
    assert text.endswith("<|im_start|>user\n") and real_target.tokenizer.decode([closing]) == "<|im_end|>"
    forbidden = eval_shingles(default_eval_dir())
    prompts, report = write_user_turns(real_target, 3, 11, forbidden, max_new_tokens=40, batch_size=12)
    assert len(prompts) == 3 and report["kept"] == 3 and report["samples"] >= 3
    turns = [p[0] for p in prompts]
    assert all(t.strip() == t and len(t.split()) >= 4 and "<|im_" not in t for t in turns), turns
    assert len(set(turns)) == 3
    assert write_user_turns(real_target, 3, 11, forbidden, max_new_tokens=40, batch_size=12)[0] == prompts  # seeded
    # what is dropped, and why
    mt_bench = (default_eval_dir() / "mt-bench.jsonl").read_text().splitlines()[0]
    copied = json.loads(mt_bench)["turns"][0]
    assert rejection(copied, "stop", set(), forbidden) == "overlap"
    assert rejection("Tell me about the sea and", "length", set(), forbidden) == "unfinished"
    assert rejection("Hi there", "stop", set(), forbidden) == "short"
    assert rejection("the cat sat down " * 6, "stop", set(), forbidden) == "repetitive"
    assert rejection("Tell me, about the sea!", "stop", {"tell me about the sea"}, forbidden) == "duplicate"
    assert rejection("Tell me about the sea", "stop", set(), forbidden) is None
    # the self source joins the mix through its writer; without one it is refused
    records, report = build_prompts(
        8,
        0,
        default_eval_dir(),
        {"math": 0.5, "self": 0.5},
        lambda n, seed, f: ([["Write a haiku about rain"]] * n, {}),
    )
    assert report["counts"]["self"] == 1 and report["counts"]["math"] == 4  # identical written turns kept once
    with pytest.raises(DSparkError, match="'self' source needs the target"):
        build_prompts(4, 0, default_eval_dir(), {"self": 1.0})
    # as a user asks for it
    out = tmp_path / "self.jsonl"
    code, err = run_cli(
        capsys, "prompts", "--out", out, "--count", 2, "--mix", "self=1", "--dtype", "float32", "--self-max-tokens", 64
    )
    assert code == 0, err
    assert json.loads(Path(f"{out}.report.json").read_text())["self_written"]["kept"] == 2
    assert [r["source"] for r in read_records(out)] == ["self", "self"]


@pytest.mark.slow
def test_code_tasks_come_from_libraries_too_with_their_docstrings_cut_to_summary_and_examples():
    from dspark.cli.args import default_eval_dir
    from dspark.training.sources import LIBRARY_MODULES, _doc_digest, _documented_functions, build_prompts

    functions = _documented_functions(LIBRARY_MODULES, library=True)
    by_library = {q.split(".")[0] for q, *_ in functions}
    assert by_library == {"numpy", "networkx", "sympy"} and len(functions) > 1000  # doubles the stdlib's ~1,400
    docs = [doc for _, _, doc, _ in functions]
    assert not any(re.search(r"^(Parameters|Returns|See Also)\n[-=]{3,}", d, re.M) for d in docs)  # sections cut ...
    assert sum(">>> " in d for d in docs) > 300  # ... but the worked examples kept
    assert not any("<" in sig or "backend_kwargs" in sig for _, sig, _, _ in functions)
    numpydoc = "Add things.\n\nParameters\n----------\nx : int\n\nExamples\n--------\n>>> add(1)\n2\n\n>>> add(2)\n3"
    assert _doc_digest(numpydoc) == "Add things.\n\n>>> add(1)\n2\n>>> add(2)\n3"
    assert _doc_digest("Plain stdlib text.\n\nMore.") == "Plain stdlib text.\n\nMore."
    records, report = build_prompts(40, 0, default_eval_dir(), {"library": 0.5, "math": 0.5})
    library = [r for r in records if r["source"] == "library"]
    assert report["counts"]["library"] == len(library) == 20 and all(r["id"].startswith("library-") for r in library)
    names = {q.split(".")[-1] for q, *_ in functions}
    texts = [r["messages"][0]["content"] for r in library]
    assert sum(bool(names & set(re.findall(r"\w+", t))) for t in texts) >= len(texts) / 2  # most name the function
    assert not any(re.search(r"function (to|that) (returns|computes|finds) ", t) for t in texts)


def test_prompt_formats(tmp_path):
    (tmp_path / "p.txt").write_text("first\n\nsecond\n")
    assert [r["messages"][0]["content"] for r in read_records(tmp_path / "p.txt")] == ["first", "second"]
    rows = read_records(write_jsonl(tmp_path / "t.jsonl", [{"turns": ["a", "b"]}, {"prompt": "c"}]))
    assert [m["role"] for m in rows[0]["messages"]] == ["user", "user"]
    plain = write_jsonl(tmp_path / "r.jsonl", [{"prompt": "c"}, {"prompt": "d"}])
    (tmp_path / "r.jsonl.gz").write_bytes(gzip.compress(plain.read_bytes()))
    assert [r["messages"] for r in read_records(tmp_path / "r.jsonl.gz")] == [
        r["messages"] for r in read_records(plain)
    ]
    (tmp_path / "broken.jsonl.gz").write_bytes(b"not gzip")
    with pytest.raises(DSparkError, match="broken.jsonl.gz: cannot read it as gzipped"):
        read_records(tmp_path / "broken.jsonl.gz")


@pytest.mark.real
def test_loss_mask_covers_assistant_tokens_only(real_target):
    tok = real_target.tokenizer
    record = {"messages": [{"role": "user", "content": "Say hi"}, {"role": "assistant", "content": "Hi there!"}]}
    (example,) = examples_from_record(tok, record, 512)
    answer = [t for t, m in zip(example.input_ids, example.loss_mask) if m]
    assert tok.decode(answer).startswith("Hi there!<|im_end|>")
    assert example.loss_mask[: example.loss_mask.index(1)] == [0] * example.loss_mask.index(1)
    exact = dict(record, assistant_token_ids=[[1, 2, 3]])
    (forced,) = examples_from_record(tok, exact, 512)
    assert forced.input_ids[-3:] == [1, 2, 3] and sum(forced.loss_mask) == 3


@pytest.mark.slow
def test_prompts_exclude_what_an_earlier_set_answered(tmp_path, capsys):
    from conftest import run_cli

    first, again = tmp_path / "first.jsonl", tmp_path / "again.jsonl"
    assert run_cli(capsys, "prompts", "--out", first, "--count", "300", "--seed", "5", "--mix", "assist=1")[0] == 0
    answered = tmp_path / "answered.jsonl.gz"
    with gzip.open(answered, "wt") as f:  # a regenerated set holding half of them, under other ids
        for line in first.read_text().splitlines()[:150]:
            f.write(json.dumps(dict(json.loads(line), id="done-" + json.loads(line)["id"])) + "\n")
    assert (
        run_cli(
            capsys,
            "prompts",
            "--out",
            again,
            "--count",
            "300",
            "--seed",
            "5",
            "--mix",
            "assist=1",
            "--exclude",
            answered,
        )[0]
        == 0
    )
    openings = lambda path: [r["messages"][0]["content"] for r in read_records(path)]
    done = set(openings(first)[:150])
    assert openings(again) == [o for o in openings(first) if o not in done] and 0 < len(openings(again)) <= 150
    assert json.loads(Path(str(again) + ".report.json").read_text())["excluded_already_answered"] == len(
        openings(first)
    ) - len(openings(again))


# ---- regeneration -------------------------------------------------------------------------------------------------
class CountingTarget:
    """Wraps a tiny target so that it can encode chat and counts the prompts it answers."""

    def __init__(self, target):
        self.inner, self.answered = target, 0
        self.tokenizer = target.tokenizer

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def encode_chat(self, messages):
        self.answered += 1
        return [3 + len(m["content"]) % 50 for m in messages]


@pytest.mark.slow
def test_regeneration_resumes_without_duplicates_or_losses(tmp_path, monkeypatch):
    target = CountingTarget(tiny_target(eos=7))
    records = [{"id": f"r{i}", "messages": [{"role": "user", "content": "x" * i}] * (1 + i % 2)} for i in range(9)]
    out = tmp_path / "regen.jsonl"
    real_stream = regen_mod.stream_plain
    calls = {"n": 0}

    def crashing_stream(*args, **kwargs):
        for item in real_stream(*args, **kwargs):
            calls["n"] += 1
            if calls["n"] == 6:
                raise KeyboardInterrupt  # killed mid-run
            yield item

    monkeypatch.setattr(regen_mod, "stream_plain", crashing_stream)
    with pytest.raises(KeyboardInterrupt):
        regen_mod.regenerate(target, records, out, max_new_tokens=5, batch_size=3, progress=False)
    with out.open("a") as f:
        f.write('{"id": "r8", "messa')  # and a torn last line
    partial = [json.loads(x)["id"] for x in out.read_text().splitlines()[:-1]]
    assert 0 < len(partial) < 9
    monkeypatch.setattr(regen_mod, "stream_plain", real_stream)
    report = regen_mod.regenerate(target, records, out, max_new_tokens=5, batch_size=3, progress=False)
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert sorted(r["id"] for r in rows) == sorted(r["id"] for r in records)  # each once, none lost
    assert report["skipped_done"] == len(partial)
    # two-turn conversations finish as they go, not after every first turn
    first_written = [json.loads(x)["id"] for x in out.read_text().splitlines()][:4]
    assert any(int(rid[1:]) % 2 == 1 for rid in first_written)
    for r in rows:
        users = sum(m["role"] == "user" for m in r["messages"])
        assert [m["role"] for m in r["messages"]] == ["user", "assistant"] * users
        assert len(r["assistant_token_ids"]) == users and r["sampling"]["temperature"] == 0.0


@pytest.mark.slow
def test_regeneration_time_limit_finishes_what_it_started_and_a_rerun_does_the_rest(tmp_path, monkeypatch):
    """--max-minutes: past the limit no conversation starts, those under way (a follow-up turn included) are written
    whole, and the next run answers the rest."""
    target = CountingTarget(tiny_target(eos=7))
    records = [{"id": f"r{i}", "messages": [{"role": "user", "content": "x" * i}] * (1 + i % 2)} for i in range(20)]
    out = tmp_path / "regen.jsonl"
    clock = {"t": 0.0}
    monkeypatch.setattr(regen_mod.time, "perf_counter", lambda: clock.__setitem__("t", clock["t"] + 1.0) or clock["t"])
    report = regen_mod.regenerate(target, records, out, max_new_tokens=5, batch_size=4, progress=False, max_seconds=3)
    first = [json.loads(x) for x in out.read_text().splitlines()]
    assert 0 < report["records_written"] == len(first) < 20 and report["records_left"] == 20 - len(first)
    for r in first:  # whole conversations only
        assert len(r["assistant_token_ids"]) == sum(m["role"] == "user" for m in r["messages"])
    report = regen_mod.regenerate(target, records, out, max_new_tokens=5, batch_size=4, progress=False)
    assert report["records_left"] == 0 and report["skipped_done"] == len(first)
    assert sorted(json.loads(x)["id"] for x in out.read_text().splitlines()) == sorted(r["id"] for r in records)


# ---- the loop (tiny target, real files) -----------------------------------------------------------------------------
def tiny_config(folder, data, out, **overrides):
    from dspark.training.config import TrainConfig

    fields = dict(
        data=str(data),
        out=str(out),
        model=str(folder),
        target_dtype="float32",
        num_draft_layers=1,
        markov_rank=8,
        block_size=4,
        batch_size=4,
        num_anchors=16,
        lr=3e-3,
        eval_every=1000,
        save_every=5,
        holdout=0.1,
        bf16=False,
        max_steps=10,
        seed=3,
        target_layer_ids=[0, 2],
        mask_token_id=63,
    )
    fields.update(overrides)
    return TrainConfig(**fields)


def test_training_precision_defaults_to_what_is_native_on_the_machine(monkeypatch):
    """Emulated bfloat16 made a training step 5.5x slower than float32 on an AVX2-only CPU: by default the target
    and the autocast use bfloat16 only on a GPU or a CPU with native bfloat16; what the user gives is kept."""
    import dspark.autotune as precision
    from dspark.training.config import TrainConfig

    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    default = TrainConfig(data="d.jsonl", out="run")
    monkeypatch.setattr(precision, "cpu_flags", lambda: {"avx2", "fma"})
    assert (default.for_device(cpu).target_dtype, default.for_device(cpu).bf16) == ("float32", False)
    assert (default.for_device(gpu).target_dtype, default.for_device(gpu).bf16) == ("bfloat16", True)
    given = TrainConfig(data="d.jsonl", out="run", target_dtype="bfloat16", bf16=False).for_device(cpu)
    assert (given.target_dtype, given.bf16) == ("bfloat16", False)
    monkeypatch.setattr(precision, "cpu_flags", lambda: {"avx2", "avx512f", "avx512_bf16"})
    assert (default.for_device(cpu).target_dtype, default.for_device(cpu).bf16) == ("bfloat16", True)


@pytest.mark.slow
def test_a_few_steps_reduce_the_loss(tiny_run, tmp_path):
    from dspark.training.trainer import train

    folder, data = tiny_run
    train(tiny_config(folder, data, tmp_path / "run", max_steps=60, save_every=60), progress=False)
    logs = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    first = {k: sum(r[k] for r in logs[:5]) / 5 for k in ("loss", "tv", "ce")}
    last = {k: sum(r[k] for r in logs[-5:]) / 5 for k in ("loss", "tv", "ce")}
    # CE is against the sampled labels: it cannot fall below the target's own entropy, so it moves least.
    assert last["loss"] < 0.8 * first["loss"] and last["tv"] < 0.8 * first["tv"] and last["ce"] < 0.9 * first["ce"]


def test_a_family_drafter_continues_on_the_portable_backbone(tiny_run, tmp_path):
    """`train --init-from FAMILY --backbone qwen3` carries every weight over (only the new q/k norms start at one),
    so a drafter trained on the target's own layers continues on the backbone that exports to other runtimes."""
    from dspark.drafter import load_drafter, port_to_qwen3
    from dspark.target import Target
    from dspark.training.trainer import train

    folder, data = tiny_run
    target = Target.load(str(folder), dtype="float32")
    train(tiny_config(folder, data, tmp_path / "family", backbone="family", max_steps=2), progress=False)
    family = load_drafter(tmp_path / "family" / "checkpoint", target)
    ported = port_to_qwen3(family, target)
    old, new = family.state_dict(), ported.state_dict()
    assert ported.config.backbone == "qwen3" and all(torch.equal(old[k], new[k]) for k in old)
    assert {k.split(".")[-2] for k in set(new) - set(old)} == {"q_norm", "k_norm"}
    assert all(torch.equal(new[k], torch.ones_like(new[k])) for k in set(new) - set(old))

    train(
        tiny_config(folder, data, tmp_path / "qwen3", init_from=str(tmp_path / "family" / "checkpoint"), max_steps=2),
        progress=False,
    )
    assert load_drafter(tmp_path / "qwen3" / "checkpoint", target).config.backbone == "qwen3"


@pytest.mark.slow
def test_a_continued_drafter_widens_its_markov_rank_keeping_what_it_learned(tiny_run, tmp_path):
    """`train --init-from D --widen-markov-rank R`: before any step the wider drafter's logits and confidences are
    D's exactly; training moves the new dimensions; the run resumes at the wider rank; a smaller rank is refused."""
    from dspark.drafter import load_drafter
    from dspark.target import Target
    from dspark.training.config import resumed_config
    from dspark.training.trainer import train

    folder, data = tiny_run
    target = Target.load(str(folder), dtype="float32")
    train(tiny_config(folder, data, tmp_path / "narrow", max_steps=3), progress=False)
    narrow = load_drafter(tmp_path / "narrow" / "checkpoint", target)
    wide = load_drafter(tmp_path / "narrow" / "checkpoint", target)
    wide.widen_markov_rank(20)
    assert wide.config.markov_rank == 20 and wide.markov_head.markov_w1.weight.shape[1] == 20
    h, prev = torch.randn(5, target.hidden_size), torch.randint(0, 64, (5,))
    for d in (narrow, wide):
        d.use_product_form("plain")
    logits = lambda d: d.base_logits(h) + d.markov_head.step(prev, h, None)[0]
    assert torch.allclose(logits(wide), logits(narrow), atol=1e-6)
    assert torch.allclose(wide.confidence_logits(h, prev), narrow.confidence_logits(h, prev), atol=1e-6)

    run = tmp_path / "wide"
    cfg = tiny_config(
        folder, data, run, init_from=str(tmp_path / "narrow" / "checkpoint"), widen_markov_rank=20, max_steps=6
    )
    train(cfg, progress=False)
    trained = load_drafter(run / "checkpoint", target)
    assert trained.config.markov_rank == 20 and trained.markov_head.markov_w2.weight[:, 8:].abs().sum() > 0
    train(resumed_config(run, {"max_steps": 8}), resume=True, progress=False)  # what `train --resume` does
    assert load_drafter(run / "checkpoint", target).config.markov_rank == 20
    with pytest.raises(DSparkError, match="can only grow"):
        train(
            tiny_config(folder, data, tmp_path / "shrink", init_from=str(run / "checkpoint"), widen_markov_rank=4),
            progress=False,
        )


@pytest.mark.slow
def test_a_continued_drafter_widens_its_draft_vocabulary_keeping_what_it_learned(tiny_run, tmp_path):
    """`train --init-from D --draft-vocab-size N` adds the most frequent answer tokens D lacks; D's Markov rows move
    with their tokens, the new ones start at zero, so before any step the wider drafter proposes what D proposed
    wherever D could; the run resumes at the wider size; a smaller size is refused."""
    from dspark.drafter import load_drafter
    from dspark.target import Target
    from dspark.training.config import resumed_config
    from dspark.training.trainer import train

    folder, data = tiny_run
    target = Target.load(str(folder), dtype="float32")
    train(tiny_config(folder, data, tmp_path / "narrow", draft_vocab_size=24, max_steps=3), progress=False)
    narrow = load_drafter(tmp_path / "narrow" / "checkpoint", target)
    wide = load_drafter(tmp_path / "narrow" / "checkpoint", target)
    wide.widen_draft_vocab(torch.tensor([0, 1, 2, 40, 41, 42, 43, 44]))
    assert set(narrow.d2t.tolist()) < set(wide.d2t.tolist()) and wide.d2t.tolist() == sorted(wide.d2t.tolist())
    rows = {t: i for i, t in enumerate(wide.d2t.tolist())}
    w2_narrow, w2_wide = narrow.markov_head.markov_w2.weight, wide.markov_head.markov_w2.weight
    for i, token in enumerate(narrow.d2t.tolist()):
        assert torch.equal(w2_wide[rows[token]], w2_narrow[i])
    new_rows = [rows[t] for t in rows if t not in set(narrow.d2t.tolist())]
    assert new_rows and not w2_wide[new_rows].any()
    # the wider head's logits on the old tokens are exactly the old ones
    h, prev = torch.randn(5, target.hidden_size), torch.randint(0, 64, (5,))
    logits = lambda d: d.base_logits(h) + d.markov_head.step(prev, h, None)[0]
    old_rows = [rows[t] for t in narrow.d2t.tolist()]
    assert torch.allclose(logits(wide)[:, old_rows], logits(narrow), atol=1e-6)

    run = tmp_path / "wide"
    cfg = tiny_config(
        folder,
        data,
        run,
        init_from=str(tmp_path / "narrow" / "checkpoint"),
        draft_vocab_size=40,
        max_steps=6,
        save_every=3,
    )
    train(cfg, progress=False)
    trained = load_drafter(run / "checkpoint", target)
    assert trained.draft_vocab_size == 40 and set(narrow.d2t.tolist()) <= set(trained.d2t.tolist())
    train(resumed_config(run, {"max_steps": 8}), resume=True, progress=False)  # what `train --resume` does
    assert load_drafter(run / "checkpoint", target).draft_vocab_size == 40
    with pytest.raises(DSparkError, match="can only grow"):
        train(
            tiny_config(folder, data, tmp_path / "shrink", init_from=str(run / "checkpoint"), draft_vocab_size=16),
            progress=False,
        )


@pytest.mark.slow
def test_copied_lr_scale_moves_the_layers_copied_from_the_target_at_its_rate(tiny_run, tmp_path):
    """--copied-lr-scale 0 keeps the backbone's layers and final norm exactly the target's top layers while the rest
    learns; the scale is kept in the checkpoint, so a resumed run goes on at the same rates."""
    from dspark.drafter import load_drafter
    from dspark.target import Target
    from dspark.training.trainer import train

    folder, data = tiny_run
    target = Target.load(str(folder), dtype="float32")
    top = target.model.get_decoder().layers[-1].state_dict()
    norm = target.model.get_decoder().norm.weight
    for scale in (0.0, 1.0):
        run = tmp_path / f"scale{scale}"
        train(tiny_config(folder, data, run, copied_lr_scale=scale, max_steps=3, save_every=2), progress=False)
        if scale == 0.0:  # resume the last step from the step-2 checkpoint: still frozen
            train(
                tiny_config(folder, data, run, copied_lr_scale=scale, max_steps=4, save_every=2),
                resume=True,
                progress=False,
            )
        drafter = load_drafter(run / "checkpoint", target)
        layer = drafter.layers[0].state_dict()
        same = [torch.equal(layer[k], v) for k, v in top.items()] + [torch.equal(drafter.norm.weight, norm)]
        assert all(same) if scale == 0.0 else not any(same[:-1])
        assert drafter.markov_head.markov_w2.weight.abs().sum() > 0  # starts at zero: the rest learned
    state = json.loads((tmp_path / "scale0.0" / "checkpoint" / "trainer_state.json").read_text())
    assert sorted({g["lr_scale"] for g in state["param_groups"]}) == [0.0, 1.0]


@pytest.mark.slow
def test_add_draft_layers_deepens_a_trained_drafter_from_exactly_where_it_was(tiny_run, tmp_path):
    """--add-draft-layers appends layers that start as identities: the deepened drafter proposes what it proposed
    before; then the new layers learn at the full rate while the copied ones keep --copied-lr-scale, also when
    resumed."""
    from dspark.drafter import load_drafter
    from dspark.sampling import SamplingParams
    from dspark.target import Target
    from dspark.training.config import resumed_config
    from dspark.training.trainer import train

    folder, data = tiny_run
    target = Target.load(str(folder), dtype="float32")
    train(tiny_config(folder, data, tmp_path / "a", max_steps=3), progress=False)
    shallow = load_drafter(tmp_path / "a" / "checkpoint", target)
    deep = load_drafter(tmp_path / "a" / "checkpoint", target)
    deep.add_layers(2, target.model)
    assert len(deep.layers) == 3 and deep.config.num_draft_layers == 3
    top = target.model.get_decoder().layers[-1].state_dict()  # the new last layer starts as the target's top layer
    assert torch.equal(deep.layers[2].self_attn.q_proj.weight, top["self_attn.q_proj.weight"])
    features = torch.randn(2, 9, shallow.fc.in_features)
    params = SamplingParams(temperature=1.0, seed=0)
    proposals = []
    for drafter in (shallow, deep):
        cache = drafter.new_cache(2)
        drafter.extend_context(cache, features, torch.tensor([9, 6]))
        proposals.append(drafter.propose(cache, torch.tensor([3, 4]), params, params.generators(2)))
    assert torch.equal(proposals[0].tokens, proposals[1].tokens)
    torch.testing.assert_close(proposals[0].probs, proposals[1].probs)
    torch.testing.assert_close(proposals[0].confidence_logits, proposals[1].confidence_logits)

    run = tmp_path / "deep"
    cfg = tiny_config(
        folder,
        data,
        run,
        init_from=str(tmp_path / "a" / "checkpoint"),
        add_draft_layers=1,
        copied_lr_scale=0.0,
        max_steps=3,
        save_every=2,
    )
    train(cfg, progress=False)
    train(resumed_config(run, {"max_steps": 4}), resume=True, progress=False)
    trained = load_drafter(run / "checkpoint", target)
    assert len(trained.layers) == 2
    old = shallow.layers[0].state_dict()
    assert all(torch.equal(v, old[k]) for k, v in trained.layers[0].state_dict().items())  # scale 0: kept
    assert trained.layers[1].self_attn.o_proj.weight.abs().sum() > 0  # started at zero, learned
    assert trained.layers[1].mlp.down_proj.weight.abs().sum() > 0
    with pytest.raises(DSparkError, match="--init-from"):
        tiny_config(folder, data, tmp_path / "x", add_draft_layers=1)


def test_a_drafters_lineage_adds_up_its_legs_through_warm_starts_resumes_and_exports(tiny_run, tmp_path, capsys):
    """Run folders do not outlive a machine, but a drafter continued with --init-from carries every earlier leg in
    its config, so its total training compute is known wherever it is measured."""
    from conftest import run_cli
    from dspark.drafter import read_checkpoint_meta, training_totals
    from dspark.training.trainer import train

    folder, data = tiny_run
    train(tiny_config(folder, data, tmp_path / "a", max_steps=2), progress=False)
    first = read_checkpoint_meta(tmp_path / "a" / "checkpoint")
    assert first["lineage"] == [] and first["progress"]["device"].startswith("cpu: ")
    assert first["progress"]["core_seconds"] >= first["progress"]["seconds"] > 0
    train(
        tiny_config(folder, data, tmp_path / "b", init_from=str(tmp_path / "a" / "checkpoint"), max_steps=3),
        progress=False,
    )
    train(
        tiny_config(folder, data, tmp_path / "b", init_from=str(tmp_path / "a" / "checkpoint"), max_steps=4),
        resume=True,
        progress=False,
    )
    code, err = run_cli(capsys, "export", tmp_path / "b" / "checkpoint", tmp_path / "shipped", "--model", folder)
    assert code == 0, err
    meta = read_checkpoint_meta(tmp_path / "shipped")
    assert [leg["run"] for leg in meta["lineage"]] == [str(tmp_path / "a")]
    totals = training_totals(meta)
    assert totals["legs"] == 2 and totals["steps"] == 2 + 4
    assert totals["tokens"] == first["progress"]["tokens"] + meta["progress"]["tokens"]
    assert totals["core_hours"] == round(
        (first["progress"]["core_seconds"] + meta["progress"]["core_seconds"]) / 3600, 2
    )
    assert totals["gpu_hours"] == 0 and totals["last_leg"]["run"] == str(tmp_path / "b")


@pytest.mark.slow
def test_killed_run_resumed_equals_uninterrupted(tiny_run, tmp_path):
    from dspark.training.trainer import train

    folder, data = tiny_run
    train(tiny_config(folder, data, tmp_path / "full", max_steps=10), progress=False)
    # The same run, stopped after its step-5 checkpoint (as a kill would leave it), then resumed.
    cfg = tiny_config(folder, data, tmp_path / "cut", max_steps=10)
    cfg_short = tiny_config(folder, data, tmp_path / "cut", max_steps=10)
    import dspark.training.trainer as trainer_mod

    original = trainer_mod.save_checkpoint
    calls = {"n": 0}

    def save_then_die(*args, **kwargs):
        original(*args, **kwargs)
        calls["n"] += 1
        raise KeyboardInterrupt

    trainer_mod.save_checkpoint = save_then_die
    try:
        with pytest.raises(KeyboardInterrupt):
            train(cfg_short, progress=False)
    finally:
        trainer_mod.save_checkpoint = original
    assert json.loads((tmp_path / "cut" / "checkpoint" / "trainer_state.json").read_text())["loop"]["step"] == 5
    train(cfg, resume=True, progress=False)
    a = load_file(str(tmp_path / "full" / "checkpoint" / "model.safetensors"))
    b = load_file(str(tmp_path / "cut" / "checkpoint" / "model.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0)
    oa = load_file(str(tmp_path / "full" / "checkpoint" / "trainer_state.safetensors"))
    ob = load_file(str(tmp_path / "cut" / "checkpoint" / "trainer_state.safetensors"))
    assert all(torch.equal(oa[k], ob[k]) for k in oa if k.startswith("state."))


@pytest.mark.slow
def test_max_minutes_fits_the_schedule_to_the_time_the_first_steps_took(tiny_run, tmp_path, monkeypatch):
    """Each training step takes 0.5 s on a fake clock; --max-minutes 0.1 (6 s) leaves, after 10 steps (5 s), room
    for 2 more: the schedule ends at 12 of the 1,000 asked, its learning rate reaches the end of its cosine, and the
    fitted length is saved, so a plain --resume keeps it."""
    import types

    import dspark.training.trainer as trainer_mod

    clock = {"t": 0.0}

    def tick():
        clock["t"] += 0.5
        return clock["t"]

    monkeypatch.setattr(trainer_mod, "time", types.SimpleNamespace(perf_counter=tick))
    folder, data = tiny_run
    trainer_mod.train(tiny_config(folder, data, tmp_path / "run", max_steps=1000, max_minutes=0.1), progress=False)
    steps = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in steps] == list(range(1, 13))
    assert steps[-1]["lr"] < 0.1 * 3e-3  # near the cosine's end (unfitted, step 12 of 1,000 is still warming up)
    saved = json.loads((tmp_path / "run" / "checkpoint" / "config.json").read_text())["training"]
    assert saved["max_steps"] == 12


@pytest.mark.slow
def test_max_minutes_fits_again_once_the_warm_up_steps_are_past(tiny_run, tmp_path, monkeypatch):
    """As on the H200: the first 20 steps take 1 s each, the rest 0.25 s (fake clock). The fit after 10 steps sees
    only slow steps (60 fit a minute); the refit after 40, from steps 21-40, lengthens the schedule to the 180 steps
    that really fit (20 s + 160 x 0.25 s), and the later refits keep it."""
    import types

    import dspark.training.trainer as trainer_mod

    clock = {"t": 0.0}
    lr_at = trainer_mod.lr_at

    def timed_lr_at(step, total, cfg):  # called once per step, between the step's two clock readings
        clock["t"] += 1.0 if step < 20 else 0.25
        return lr_at(step, total, cfg)

    monkeypatch.setattr(trainer_mod, "time", types.SimpleNamespace(perf_counter=lambda: clock["t"]))
    monkeypatch.setattr(trainer_mod, "lr_at", timed_lr_at)
    folder, data = tiny_run
    trainer_mod.train(tiny_config(folder, data, tmp_path / "run", max_steps=1000, max_minutes=1.0), progress=False)
    steps = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert steps[-1]["step"] == 180 and steps[-1]["seconds"] == 60.0


def test_resumed_run_takes_appended_data_and_extends_its_feature_cache(tiny_run, tmp_path):
    """One run across sessions: trained on the first records, resumed on a file that appends more. The appended
    examples get their own feature-cache build (equal to the target run live), join from a new epoch, and the
    checkpoint remembers the larger data; data that does not begin with the records seen is refused."""
    from dspark.target import Target
    from dspark.training.batches import load_examples
    from dspark.training.config import resumed_config
    from dspark.training.features import CachedFeatures, OnlineFeatures
    from dspark.training.trainer import train

    folder, data = tiny_run
    lines = data.read_text().splitlines(keepends=True)
    first, everything = tmp_path / "first.jsonl", tmp_path / "everything.jsonl"
    first.write_text("".join(lines[: len(lines) // 2]))
    everything.write_text("".join(lines))
    cache, out = tmp_path / "cache", tmp_path / "run"
    train(tiny_config(folder, first, out, max_steps=4, target_topk=8, feature_cache=str(cache)), progress=False)
    target = Target.load(str(folder))
    before, _, _ = load_examples(target, str(first), 1024, 0.1)

    train(resumed_config(out, {"data": str(everything), "max_steps": 8}), resume=True, progress=False)
    examples, _, ids = load_examples(target, str(everything), 1024, 0.1)
    assert (cache / f"from-{len(before)}" / "index.json").exists() and len(examples) > len(before)
    state = json.loads((out / "checkpoint" / "trainer_state.json").read_text())
    assert state["loop"]["step"] == 8 and state["loop"]["epoch"] >= 1
    assert state["loop"]["data"]["records"] == len(ids) and state["train_config"]["data"] == str(everything)
    steps = [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 9))
    cached = CachedFeatures(cache)
    target = Target.load(str(folder), dtype="float32", layer_ids=[0, 2])  # as the run read it
    cached.check(examples, target, 8)
    appended = examples[len(before) :][:2]
    a, b = cached(appended), OnlineFeatures(target, 8)(appended)
    # equal up to bfloat16 rounding (the cache ran them in another batch); another example's features are far off
    torch.testing.assert_close(a.features.float(), b.features.float(), rtol=1e-2, atol=0.05)

    reordered = tmp_path / "reordered.jsonl"
    reordered.write_text("".join(lines[1:] + lines[:1]))
    with pytest.raises(DSparkError, match="does not begin with them"):
        train(resumed_config(out, {"data": str(reordered), "max_steps": 9}), resume=True, progress=False)


def test_periodic_real_decoding_evaluation_logs_what_the_engine_measures(tiny_run, tmp_path):
    """`--decode-eval-every`: τ of real greedy decoding of a fixed slice per evaluation set, logged in metrics.jsonl,
    equal to what the engine measures with the saved checkpoint afterwards."""
    from dspark.decoding.engine import SpeculativeEngine
    from dspark.decoding.policy import FixedLength
    from dspark.drafter import load_drafter
    from dspark.target import Target
    from dspark.training.trainer import train

    folder, data = tiny_run
    sets = []
    for name, words in (("alpha", "t5 t9 t30"), ("beta", "t7 t8 t40 t41")):
        sets.append(tmp_path / f"{name}.jsonl")
        sets[-1].write_text("".join(json.dumps({"turns": [f"{words} t{11 + i}"]}) + "\n" for i in range(3)))
    train(
        tiny_config(
            folder,
            data,
            tmp_path / "run",
            max_steps=4,
            decode_eval_every=2,
            decode_eval_sets=[str(p) for p in sets],
            decode_eval_prompts=2,
            decode_eval_tokens=10,
        ),
        progress=False,
    )
    logs = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logs if "decode_tau" in r] == [2, 4]
    logged = logs[-1]["decode_tau"]
    assert set(logged) == {"alpha", "beta"}

    target = Target.load(str(folder))
    engine = SpeculativeEngine(target, load_drafter(tmp_path / "run" / "checkpoint", target), FixedLength())
    for name, path in zip(("alpha", "beta"), sets):
        prompts = [target.encode_chat(json.loads(line)["turns"][0]) for line in path.read_text().splitlines()[:2]]
        results = engine.generate(prompts, 10)
        tau = sum(r.stats.tokens for r in results) / sum(r.stats.rounds for r in results)
        assert logged[name] == round(tau, 3)
    from dspark.bench.report import training_curves

    training_curves({"run": tmp_path / "run"}, tmp_path / "curve.png")  # with its real-decoding panel
    assert (tmp_path / "curve.png").stat().st_size > 0


@pytest.mark.slow
def test_held_out_tau_is_split_by_prompt_source(tiny_run):
    from conftest import tiny_drafter
    from dspark.target import Target
    from dspark.training.batches import load_examples
    from dspark.training.evaluation import evaluate
    from dspark.training.features import OnlineFeatures

    folder, data = tiny_run
    target = Target.load(str(folder))
    examples, _, _ = load_examples(target, str(data), 1024, 0.0)
    examples = examples[:16]
    drafter = tiny_drafter(target, block_size=4, mask_token_id=63)
    cfg = tiny_config(folder, data, "unused")
    for e in examples:
        e.source = "math"
    same = evaluate(drafter, OnlineFeatures(target, 0), examples, cfg, 4)
    assert same["tau_by_source"] == {"math": same["tau_greedy"]}
    for i, e in enumerate(examples):
        e.source = ("math", "code")[i % 2]
    mixed = evaluate(drafter, OnlineFeatures(target, 0), examples, cfg, 4)
    assert set(mixed["tau_by_source"]) == {"code", "math"} and mixed["tau_greedy"] == same["tau_greedy"]
    assert min(mixed["tau_by_source"].values()) <= mixed["tau_greedy"] <= max(mixed["tau_by_source"].values())
    # the evaluation's anchors do not follow the training setting
    assert evaluate(drafter, OnlineFeatures(target, 0), examples, replace(cfg, num_anchors=2), 4) == mixed


def test_evaluation_slice_reaches_every_file_of_a_concatenated_mix():
    from dspark.records import Example, spread_slice

    # Three files one after another, as `zcat data/*regen*.jsonl.gz` makes them; the last is the smallest.
    held = [
        Example([1, 2], [0, 1], source=s) for s, n in (("chat", 40), ("code", 40), ("assist", 20)) for _ in range(n)
    ]
    chosen = spread_slice(held, 64)
    assert len(chosen) == 64 and len({id(e) for e in chosen}) == 64
    assert {e.source for e in chosen} == {"chat", "code", "assist"}  # a head slice held_out[:64] sees chat and code
    assert spread_slice(held[:10], 64) == held[:10]


@pytest.mark.slow
def test_trained_checkpoint_decodes_losslessly(tiny_run, tmp_path):
    from dspark.decoding.engine import SpeculativeEngine
    from dspark.decoding.plain import generate_plain
    from dspark.drafter import load_drafter
    from dspark.target import Target
    from dspark.training.trainer import train

    folder, data = tiny_run
    train(tiny_config(folder, data, tmp_path / "run", max_steps=5), progress=False)
    target = Target.load(str(folder))
    drafter = load_drafter(tmp_path / "run" / "checkpoint", target)
    prompts = [[1, 7, 9, 3, 1], [1, 44, 3, 1]]
    expected = [r.token_ids for r in generate_plain(target, prompts, 20)]
    assert [r.token_ids for r in SpeculativeEngine(target, drafter).generate(prompts, 20)] == expected


def test_online_q_scores_repeated_positions_once_and_answers_each_pair(target, monkeypatch):
    """Overlapping blocks ask for the same position many times; each asked (row, position) still gets its own q."""
    from dspark.records import Example
    from dspark.training.features import OnlineFeatures

    examples = [Example(list(range(10, 22)), [0] * 4 + [1] * 8), Example(list(range(30, 39)), [0] * 3 + [1] * 6)]
    batch = OnlineFeatures(target, 5)(examples)
    scored = []
    original = target.logits_from_hidden
    monkeypatch.setattr(target, "logits_from_hidden", lambda h: scored.append(len(h)) or original(h))
    rows = torch.tensor([0, 1, 0, 0, 1, 1, 0])
    positions = torch.tensor([5, 3, 5, 7, 3, 8, 4])
    q = batch.target_dist(rows, positions)
    assert sum(scored) == 5  # (0,5) (1,3) (0,7) (1,8) (0,4)
    for i, (r, p) in enumerate(zip(rows.tolist(), positions.tolist())):
        alone = batch.target_dist(torch.tensor([r]), torch.tensor([p]))
        torch.testing.assert_close(q.probs[i], alone.probs[0])
        assert torch.equal(q.ids[i], alone.ids[0])


@pytest.mark.slow
def test_dflash_preset_has_no_heads_and_feature_cache_matches_online(tiny_run, tmp_path):
    from dspark.drafter import load_drafter
    from dspark.target import Target
    from dspark.training.trainer import train

    folder, data = tiny_run
    online = train(tiny_config(folder, data, tmp_path / "online", max_steps=3, target_topk=8), progress=False)
    cached = train(
        tiny_config(
            folder, data, tmp_path / "cached", max_steps=3, target_topk=8, feature_cache=str(tmp_path / "cache")
        ),
        progress=False,
    )
    assert (tmp_path / "cache" / "index.json").exists()
    assert cached["tv"] == pytest.approx(online["tv"], rel=1e-3)
    # the same data through other layers, another precision or another top-K would read wrong features silently
    for other in (dict(target_layer_ids=[1, 2]), dict(target_dtype="bfloat16"), dict(target_topk=4)):
        with pytest.raises(DSparkError, match="feature cache was built for"):
            train(
                tiny_config(
                    folder,
                    data,
                    tmp_path / "other",
                    **{"max_steps": 1, "target_topk": 8, **other},
                    feature_cache=str(tmp_path / "cache"),
                ),
                progress=False,
            )
    train(
        tiny_config(folder, data, tmp_path / "dflash", max_steps=3, preset="dflash", markov_rank=None), progress=False
    )
    d = load_drafter(tmp_path / "dflash" / "checkpoint", Target.load(str(folder)))
    assert d.markov_head is None and d.confidence_head is None


@pytest.mark.slow
def test_torchrun_two_processes_equal_one_process_with_accumulation(tiny_run, tmp_path):
    """2 DDP processes × batch 2 take the same steps as one process accumulating 2 micro-batches of 2: the same
    batches, the same anchors, the same global loss, so the same weights (up to float summation order)."""
    from dspark.training.trainer import train

    folder, data = tiny_run
    out = tmp_path / "ddp"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        "--master_port=29517",
        "-m",
        "dspark.cli",
        "train",
        "--data",
        str(data),
        "--out",
        str(out),
        "--model",
        str(folder),
        "--target-dtype",
        "float32",
        "--num-draft-layers",
        "1",
        "--markov-rank",
        "8",
        "--block-size",
        "4",
        "--batch-size",
        "2",
        "--max-steps",
        "4",
        "--save-every",
        "2",
        "--target-layer-ids",
        "0,2",
        "--mask-token-id",
        "63",
        "--no-bf16",
        "--quiet",
        "--threads",
        "1",
        "--num-anchors",
        "16",
        "--lr",
        "3e-3",
        "--seed",
        "3",
        "--holdout",
        "0.1",
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    state = json.loads((out / "checkpoint" / "trainer_state.json").read_text())
    assert state["loop"]["step"] == 4
    train(
        tiny_config(folder, data, tmp_path / "single", max_steps=4, save_every=2, batch_size=2, grad_accum=2),
        progress=False,
    )
    a = load_file(str(out / "checkpoint" / "model.safetensors"))
    b = load_file(str(tmp_path / "single" / "checkpoint" / "model.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-5, msg=lambda m, k=k: f"{k}: {m}")
    assert (
        state["loop"]["tokens"]
        == json.loads((tmp_path / "single" / "checkpoint" / "trainer_state.json").read_text())["loop"]["tokens"]
    )


def test_a_base_model_without_chat_template_regenerates_and_trains(tiny_run, tmp_path):
    """Plain-text prompts end to end: what regeneration fed the target is exactly what training reads."""
    import shutil

    from transformers import AutoTokenizer

    from dspark.records import examples_from_record, read_records
    from dspark.target import Target
    from dspark.training.regenerate import regenerate
    from dspark.training.trainer import train

    folder, _ = tiny_run
    base = tmp_path / "base"
    shutil.copytree(folder, base)
    tok = AutoTokenizer.from_pretrained(base)
    tok.chat_template = None
    (base / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((base / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (base / "tokenizer_config.json").write_text(json.dumps(config))
    target = Target.load(str(base))
    assert not target.tokenizer.chat_template
    prompts = [
        {"id": f"b{i}", "messages": [{"role": "user", "content": f"t{5 + i} t{9 + i} t{20 + i}"}]} for i in range(12)
    ]
    data = tmp_path / "regen.jsonl"
    regenerate(target, prompts, data, max_new_tokens=12, batch_size=4, progress=False)
    record = read_records(data)[0]
    example = examples_from_record(target.tokenizer, record, 1024)[0]
    prompt = target.encode_chat(record["messages"][:1])
    assert example.input_ids[: len(prompt)] == prompt and example.loss_mask[: len(prompt)] == [0] * len(prompt)
    train(tiny_config(base, data, tmp_path / "run", max_steps=2, holdout=0.0), progress=False)
    assert (tmp_path / "run" / "checkpoint" / "model.safetensors").is_file()


def test_bigram_init_puts_the_datas_bigrams_into_the_markov_head(target):
    """--markov-init bigram: with a rank covering the matrix, W2·W1[prev] is exactly the centred bigram log-probability
    of the answers, restricted to the draft vocabulary; a bigram counts only inside an answer (as anchors do)."""
    from conftest import tiny_drafter
    from dspark.records import Example
    from dspark.training.init import init_markov_from_bigrams

    drafter = tiny_drafter(target, markov_rank=8, draft_vocab_size=6)
    drafter.set_draft_vocab(torch.tensor([10, 11, 12, 13, 14, 15]))
    # answers: 10 -> 11 three times, 10 -> 12 once, 11 -> 13 twice; 50 -> 10 crosses from the prompt: not counted
    examples = [
        Example([50, 10, 11, 13], [0, 1, 1, 1]),
        Example([50, 10, 11, 13], [0, 1, 1, 1]),
        Example([50, 10, 11], [0, 1, 1]),
        Example([50, 10, 12], [0, 1, 1]),
    ]
    kept = init_markov_from_bigrams(drafter, examples, max_rows=2, smoothing=0.5)
    assert kept == pytest.approx(1.0, abs=1e-4)  # 2 rows, rank 8: nothing is lost
    bias = drafter.markov_head.markov_w2(drafter.markov_head.markov_w1(torch.tensor([10, 11])))
    counts = torch.tensor([[0, 3, 1, 0, 0, 0], [0, 0, 0, 2, 0, 0]], dtype=torch.float)
    logp = (counts + 0.5).log() - (counts.sum(1, keepdim=True) + 3).log()
    torch.testing.assert_close(bias, logp - logp.mean(1, keepdim=True), atol=1e-4, rtol=1e-4)
    assert drafter.markov_head.markov_w1.weight[50].abs().sum() == 0  # never a previous answer token: no bias


@pytest.mark.skipif(not hasattr(ctypes.CDLL(None), "malloc_trim"), reason="needs glibc's malloc_trim")
def test_return_freed_memory_hands_the_heaps_free_blocks_back_to_the_system():
    """A CPU training run grew ~40 MB a step on blocks glibc kept after free(); the trainer trims every ten steps."""
    from dspark.training.runtime import return_freed_memory

    def rss():
        return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    blocks = [bytearray(32 * 1024) for _ in range(8192)]  # 256 MB on the heap, below glibc's mmap threshold
    allocated = rss()
    del blocks[:-1]  # the last block pins the heap's top, so free() alone gives next to nothing back
    held = rss()
    assert allocated - held < 64 << 20
    return_freed_memory()
    assert held - rss() > 200 << 20


@pytest.mark.slow
def test_the_recipe_can_fit_what_it_trains_on(tiny_run, tmp_path):
    """The overfit check: trained long enough on a few answers with the shipped drafter's loss (cross-entropy only),
    the drafter accepts at the first draft position on those same answers (teacher-forced) almost always. A recipe
    that cannot fit its own training data is broken (misaligned features, anchors, mask tokens or labels), not short
    of data. (The paper's default mix, 0.1 CE + 0.9 TV, plateaus here at 0.83-0.87: docs/experiments.md.)"""
    from dspark.drafter import load_drafter
    from dspark.records import read_records
    from dspark.target import Target
    from dspark.training.batches import load_examples
    from dspark.training.evaluation import evaluate
    from dspark.training.features import OnlineFeatures
    from dspark.training.trainer import train

    folder, data = tiny_run
    few = tmp_path / "few.jsonl"
    few.write_text("".join(json.dumps(r) + "\n" for r in read_records(data)[:8]))
    cfg = tiny_config(
        folder,
        few,
        tmp_path / "run",
        max_steps=400,
        holdout=0.0,
        batch_size=8,
        save_every=400,
        num_anchors=32,
        ce_weight=1.0,
        tv_weight=0.0,
    )
    train(cfg, progress=False)
    target = Target.load(str(folder))
    drafter = load_drafter(tmp_path / "run" / "checkpoint", target).float()
    examples, _, _ = load_examples(target, str(few), cfg.max_length, 0.0, False)
    fit = evaluate(drafter, OnlineFeatures(target, 0), examples, cfg, 8)
    assert fit["accept_by_position"][0] >= 0.95, fit
