"""The engine's measurements: verify cost per batch shape, the per-machine precision choice, the engine benchmark."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import decode_plain_and_speculative, needs_fbgemm, tiny_drafter, tiny_target
from dspark.decoder import PRODUCTS
from dspark.drafter.suffix import ANSWER_INDEX, write_answer_index
from dspark.products import Float32Weight
from dspark.target import Target


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


def on_the_4bit_grid(target):
    """The target with every layer matrix as a Q4_1 file dequantizes to: 16 levels from min to max per 32 columns."""
    for name, param in target.model.named_parameters():
        if param.ndim == 2 and "embed" not in name and "lm_head" not in name:
            groups = param.data.float().view(param.shape[0], -1, 32)
            low, high = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)
            step = (high - low) / 15
            param.data.copy_((torch.round((groups - low) / step) * step + low).view_as(param))
    return target


@pytest.mark.parametrize("weights", ["float", "from a 4-bit file"])
@pytest.mark.parametrize("flags", [{"avx2", "fma"}, {"avx2", "amx_bf16"}])
def test_precision_is_the_cheapest_measured_here_whatever_the_cpu_flags(monkeypatch, tmp_path, weights, flags):
    """On every CPU, with or without native bfloat16, the cheapest measured of the precisions that keep the model's
    weights: int4 is a candidate only for weights that already sit on its grid, int8 never."""
    from dspark import autotune as precision

    monkeypatch.setenv("DSPARK_CACHE", str(tmp_path))
    monkeypatch.setattr(precision, "cpu_flags", lambda: flags)
    loads = []

    def load(precision):
        loads.append(precision)
        dtype = torch.float32 if precision == "float32" else torch.bfloat16
        target = tiny_target(hidden=64, dtype=dtype)
        if weights != "float":
            target = on_the_4bit_grid(target)
        return target.quantize(precision) if precision in ("int8", "int4") else target

    choice = precision.choose_precision("tiny", load)
    assert loads == ["float32", "bfloat16", "int4"]
    if weights == "float":
        assert set(choice.step_ms) == {"float32", "bfloat16"} and "int4 left out" in choice.reason
    else:
        assert set(choice.step_ms) == {"float32", "bfloat16", "int4"} and "left out" not in choice.reason
    faster = min(choice.step_ms, key=lambda d: choice.step_ms[d]["1"] + choice.step_ms[d]["8"])
    assert choice.dtype == faster
    assert ("amx_bf16" in choice.reason) == ("amx_bf16" in flags) and "measured here" in choice.reason
    assert precision.choose_precision("tiny", load) == choice and len(loads) == 3  # cached per machine


@pytest.mark.parametrize("native", [False, True])
def test_auto_never_picks_a_precision_that_is_not_batch_invariant_here(monkeypatch, tmp_path, native):
    """Where the fastest precision's real forward is not batch-invariant on the machine (float32's kernels round by
    row count here), auto leaves it out, says so, and takes the next fastest that is."""
    from dspark import autotune
    from dspark.scheduling.profile import CostTable

    monkeypatch.setenv("DSPARK_CACHE", str(tmp_path))
    monkeypatch.setattr(autotune, "cpu_flags", lambda: {"avx2", "avx512_bf16"} if native else {"avx2"})
    targets = {"float32": tiny_target(hidden=64), "bfloat16": tiny_target(hidden=64, dtype=torch.bfloat16)}
    targets["int4"] = on_the_4bit_grid(tiny_target(hidden=64, dtype=torch.bfloat16)).quantize("int4")
    targets["float32"].decoder.min_rows = 1  # products of 1-3 rows take another kernel: not invariant
    cost = {"float32": 1.0, "bfloat16": 2.0, "int4": 3.0}  # float32 measured fastest, then bfloat16, int4 last

    def timed(target, token_counts, **_):
        return CostTable(list(token_counts), [cost[target.precision] * n for n in token_counts])

    monkeypatch.setattr(autotune, "profile_target", timed)
    choice = autotune.choose_precision("tiny", targets.__getitem__)
    assert choice.dtype == "bfloat16" and set(choice.step_ms) == {"float32", "bfloat16", "int4"}
    assert "float32 left out: not batch-invariant" in choice.reason and "int4 left out" not in choice.reason


def tiny_engine_bench(tiny_run, tmp_path, dtypes, progress=lambda _: None, **options) -> dict:
    """`bench engine` on the tiny regenerated target with a tiny drafter, one prompt, the smallest settings."""
    from dspark.bench.engine import run_engine_bench

    folder, _ = tiny_run
    target = Target.load(str(folder))
    tiny_drafter(target, block_size=3, mask_token_id=63).save(tmp_path / "drafter", target.identity())
    write_answer_index([[5, 9, 30, 31, 32] * 2], tmp_path / "drafter" / ANSWER_INDEX)  # the race's suffix rows
    evalset = tmp_path / "evalset.jsonl"
    evalset.write_text(json.dumps({"turns": ["t5 t9 t30"]}) + "\n")
    return run_engine_bench(
        str(folder),
        dtypes,
        tmp_path / "drafter",
        [str(evalset)],
        6,
        counts=(1, 2),
        context=8,
        repeats=1,
        bandwidth_gib=0.01,
        progress=progress,
        **options,
    )


def test_engine_bench_reports_every_engine(tiny_run, tmp_path, monkeypatch):
    from dspark.bench.report import engine_plot, engine_section
    from dspark.bench.run import machine_info

    # As measured on a quiet machine: a tiny model is all Python, not worth packing (a busy one may time it otherwise)
    monkeypatch.setattr("dspark.autotune.choose_product_forms", lambda target, repeats=3: target)
    run = tiny_engine_bench(tiny_run, tmp_path, ["float32"])
    assert run["llama_cpp"] is None  # a local folder ships no GGUF
    engines = {r["engine"] for r in run["forward"]}
    assert engines == {"ours", "hf", "bandwidth bound"}
    row = run["decode"][0]
    spec = ("dspark", "dspark+sched", "suffix", "dspark+suffix", "dspark+suffix+sched")
    assert row["ours"] > 0 and row["hf"] > 0 and all(row[f"{e} identical"] for e in spec)
    run.update(machine=machine_info(), when="now", command="dspark bench-engine")
    text = engine_section(run, "dspark bench-engine", "engine.png")
    assert "| float32 | ours |" in text and "bandwidth bound" in text and "dspark+suffix+sched" in text
    assert engine_plot(run, tmp_path / "engine.png").stat().st_size > 1000


@pytest.mark.slow
def test_engine_bench_races_the_compiled_int4_step_beside_the_eager_one(tiny_run, tmp_path, monkeypatch):
    monkeypatch.setenv("DSPARK_CACHE", str(tmp_path / "cache"))
    lines: list[str] = []
    run = tiny_engine_bench(tiny_run, tmp_path, ["int4", "bfloat16"], progress=lines.append, compiled=True)
    assert ("int4", "ours, compiled") in {(r["dtype"], r["engine"]) for r in run["forward"]}
    compiled = [r for r in run["decode"] if r["dtype"] == "int4, compiled"]
    assert len(compiled) == 1 and compiled[0]["ours"] > 0
    assert compiled[0]["dspark identical"] and compiled[0]["dspark+sched identical"]
    assert "bfloat16: no compiled step (--compile runs int4)" in lines  # said, not silently skipped


def test_int4_weights_recover_a_q4_1_grid_exactly():
    """Weights that are a step and a minimum per group of 32 times 16 levels (what a Q4_1 file dequantizes to) come
    back exactly: multiplying the identity by them returns every weight."""
    from dspark.products import Int4Weight, linear

    torch.manual_seed(0)
    levels = torch.randint(0, 16, (48, 64)).float()
    levels[:, ::32], levels[:, 1::32] = 0, 15  # every group spans its whole grid, as Q4_1's quantizer makes it
    step = torch.tensor([2.0**-k for k in range(4, 10)]).repeat(16)[:96].view(48, 2)  # bfloat16-exact
    low = -8 * step
    weight = levels * step.repeat_interleave(32, 1) + low.repeat_interleave(32, 1)
    product = linear(torch.eye(64, dtype=torch.bfloat16), Int4Weight(weight))
    assert torch.equal(product.float(), weight.T)


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_a_quantized_target_is_close_to_float_and_speculation_stays_exact(kind):
    """Weight-only int8 and int4: logits near the float model's; plain and speculative decoding of the quantized
    target agree token for token (they share it), under a noisy oracle that gets most drafts accepted."""
    exact = tiny_target(eos=7, hidden=64)
    quantized = tiny_target(eos=7, hidden=64, dtype=torch.bfloat16).quantize(kind)
    assert quantized.precision == kind
    ids = torch.randint(0, 90, (2, 12))
    a, b = exact.forward_sequences(ids).logits, quantized.forward_sequences(ids).logits
    tolerance = 0.05 if kind == "int8" else 0.25  # 16 levels a group of random weights: coarse, but near
    assert not torch.equal(a, b) and (a - b).abs().max() < tolerance * a.abs().max()
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() > 0.8
    expected, results = decode_plain_and_speculative(quantized)
    assert [r.token_ids for r in results] == expected
    assert sum(r.stats.tokens - r.stats.rounds for r in results) > 20


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_a_quantized_target_reads_prompts_with_its_float_weights(kind):
    """A prefill of a quantized target multiplies by the bfloat16 weights it was quantized from (the quantized kernels'
    cost grows with every row): its cache is the bfloat16 target's, bit for bit, alone or beside other prompts, while a
    step after it computes with the quantized weights."""
    from dspark.products import packing_available

    bf16 = tiny_target(eos=7, hidden=64, dtype=torch.bfloat16)
    bf16.use_packed_weights(packing_available(bf16.lm_head.weight))  # the form a quantized target's prefill takes
    quantized = tiny_target(eos=7, hidden=64, dtype=torch.bfloat16).quantize(kind)
    ids, lengths = torch.randint(0, 90, (2, 20)), torch.tensor([20, 13])
    caches = {}
    for name, target in (("bf16", bf16), ("quantized", quantized)):
        caches[name] = target.new_cache(2)
        out = target.prefill(caches[name], ids, lengths)
        alone = target.prefill(target.new_cache(1), ids[1:, :13]).logits
        assert torch.equal(out.logits[1:], alone)
        caches[name + " logits"] = out.logits
    assert torch.equal(caches["bf16"].k, caches["quantized"].k) and torch.equal(caches["bf16"].v, caches["quantized"].v)
    if kind == "int4":  # int8 quantizes the LM head too
        assert torch.equal(caches["bf16 logits"], caches["quantized logits"])
    step = torch.tensor([[4], [5]])
    after = {name: t.forward(caches[name], step).logits for name, t in (("bf16", bf16), ("quantized", quantized))}
    assert not torch.equal(after["bf16"], after["quantized"])


@pytest.mark.parametrize("form", ["float32", "quantized"])
def test_a_quantized_target_reads_prompts_in_another_form_alike_alone_and_in_a_batch(form):
    """The other prefill forms, float32 copies of the float weights or the quantized kernels themselves: a prompt's
    logits are bitwise the same alone and beside another prompt, its cache near the bfloat16 form's but not its
    own, and plain and speculative decoding still agree token for token."""
    target = tiny_target(eos=7, hidden=64, dtype=torch.bfloat16).quantize("int4")
    ids, lengths = torch.randint(0, 90, (2, 20)), torch.tensor([20, 13])
    caches = {}
    for name in ("bfloat16", form):
        target.decoder.use_prefill_form(name)
        caches[name] = target.new_cache(2)
        out = target.prefill(caches[name], ids, lengths)
        assert torch.equal(out.logits[1:], target.prefill(target.new_cache(1), ids[1:, :13]).logits)
    keys = caches[form].k.float(), caches["bfloat16"].k.float()
    assert torch.allclose(*keys, atol=0.15 if form == "quantized" else 0.02)
    # The form is in effect: float32 copies are read (where bfloat16 products sum in float32, as on AVX-512-BF16, the
    # cache may come out bitwise equal to the bfloat16 form's), or the quantized matrices, whose cache must differ.
    if form == "float32":
        assert all(
            isinstance(getattr(layer, name), Float32Weight)
            for layer in target.decoder.prefill_layers
            for name in PRODUCTS
        )
    else:
        assert target.decoder.prefill_layers is None and not torch.equal(*keys)
    expected, results = decode_plain_and_speculative(target)
    assert [r.token_ids for r in results] == expected


def test_the_prefill_form_is_the_fastest_measured_here_and_kept(monkeypatch, tmp_path):
    """A quantized target reads prompts in the form a timed prompt found fastest on the machine, measured once."""
    from dspark import autotune
    from dspark.errors import DSparkError

    monkeypatch.setenv("DSPARK_CACHE", str(tmp_path))
    target = tiny_target(hidden=64, dtype=torch.bfloat16).quantize("int4")
    seconds = {"bfloat16": 0.3, "float32": 0.06, "quantized": 0.12}  # as on a CPU without native bfloat16
    clock = [0.0]
    monkeypatch.setattr(autotune.time, "perf_counter", lambda: clock[0])
    prefill = target.prefill

    def timed(*args, **kwargs):  # a prefill takes its form's time on the fake clock
        clock[0] += seconds[target.decoder.prefill_form]
        return prefill(*args, **kwargs)

    monkeypatch.setattr(target, "prefill", timed)
    assert autotune.tune(target).decoder.prefill_form == "float32"
    record = json.loads(next((tmp_path / "kernels").glob("*prefill*")).read_text())
    assert record["prefill_form"] == "float32" and set(record["prompt_ms"]) == set(seconds)
    again = tiny_target(hidden=64, dtype=torch.bfloat16).quantize("int4")
    monkeypatch.setattr(again, "prefill", lambda *a, **k: pytest.fail("measured again"))
    assert autotune.tune(again).decoder.prefill_form == "float32"  # read from the cache
    with pytest.raises(DSparkError, match="unknown prefill form"):
        again.decoder.use_prefill_form("float16")


@needs_fbgemm
@pytest.mark.parametrize(
    "step, verify, faster",
    [
        (0.0107, 0.047, True),  # a step level (here 7 % slower), a verify much faster: as on a 2-core AVX2-only EPYC
        (0.010, 0.063, False),  # both level
        (0.008, 0.070, False),  # a faster step does not make up for a slower verify
    ],
)
def test_the_lm_head_takes_float16_where_it_is_measured_faster_and_the_drafter_follows(
    monkeypatch, tmp_path, step, verify, faster
):
    """tune times a step and an 8-token verify with the target's own head (here 10 and 65 ms) and with FBGEMM's
    float16 head, keeps the float16 one only where the two together are clearly faster, records it, and reads it
    back unmeasured; a drafter loaded for the target multiplies in the same form."""
    from dspark import autotune
    from dspark.drafter import load_drafter
    from dspark.products import Float16Weight, PackedLinear

    monkeypatch.setenv("DSPARK_CACHE", str(tmp_path))
    monkeypatch.setattr(autotune, "TIMED_HEAD_WEIGHTS", 0)  # the tiny head counts as one worth timing
    target = tiny_target(hidden=64, dtype=torch.bfloat16).quantize("int4")
    seconds = {("model", 1): 0.010, ("model", 8): 0.065, ("float16", 1): step, ("float16", 8): verify}
    clock = [0.0]
    monkeypatch.setattr(autotune.time, "perf_counter", lambda: clock[0])
    forward = target.forward

    def timed(cache, ids, *args, **kwargs):  # a forward takes its head form's time for its width on the fake clock
        clock[0] += seconds.get((target.head.form_name, ids.shape[1]), 0.0)  # prompts: no time
        return forward(cache, ids, *args, **kwargs)

    monkeypatch.setattr(target, "forward", timed)
    assert autotune.tune(target).head.form_name == ("float16" if faster else "model")
    record = json.loads(next((tmp_path / "kernels").glob("*head*")).read_text())
    assert record["float16_head"] is faster and set(record["verify_8_ms"]) == {"model", "float16"}
    again = tiny_target(hidden=64, dtype=torch.bfloat16).quantize("int4")
    monkeypatch.setattr(again, "forward", lambda *a, **k: pytest.fail("measured again"))
    assert autotune.tune(again).head.form_name == target.head.form_name  # read from the cache
    tiny_drafter(again, draft_vocab_size=40).save(tmp_path / "d", again.identity())
    drafter = load_drafter(tmp_path / "d", again)
    forms = {type(m.form) for m in drafter.modules() if isinstance(m, PackedLinear)}
    assert (forms == {Float16Weight}) is faster


def test_closeness_counts_agreement_kl_and_likelihood():
    from dspark.bench.quality import closeness

    reference = torch.log_softmax(torch.tensor([[2.0, 0.0, 0.0], [0.0, 3.0, 0.0]]), -1)
    other = torch.log_softmax(torch.tensor([[2.0, 0.0, 0.0], [0.0, 0.0, 3.0]]), -1)
    same = closeness(reference, reference, [0, 1])
    assert same["agree"] == 2 and abs(same["kl"]) < 1e-6
    assert abs(same["nll"] + float(reference[0, 0] + reference[1, 1])) < 1e-5
    apart = closeness(reference, other, [0, 1])
    expected_kl = float((reference[1].exp() * (reference[1] - other[1])).sum())
    assert apart["agree"] == 1 and abs(apart["kl"] - expected_kl) < 1e-5


def test_quality_bench_reads_each_precision_against_float32(tiny_run, tmp_path):
    from dspark.bench.quality import overall, run_quality_bench
    from dspark.bench.report import quality_plot, quality_section
    from dspark.bench.run import machine_info

    folder, _ = tiny_run
    evalset = tmp_path / "evalset.jsonl"
    evalset.write_text("".join(json.dumps({"turns": [t]}) + "\n" for t in ("t5 t9 t30", "t7 t7 t2 t40")))
    run = run_quality_bench(str(folder), ["int8"], [str(evalset)], 2, 12, llama_cpp=True, progress=lambda _: None)
    assert run["llama_cpp"] is None  # a local folder ships no GGUF
    exact, quantized = overall(run)
    assert exact["precision"] == "float32" and exact["tokens"] > 10
    assert exact["top1_agreement"] == 1.0 and exact["kl"] == 0.0 and exact["identical"] == exact["prompts"] == 2
    assert quantized["precision"] == "int8" and quantized["tokens"] == exact["tokens"] and quantized["kl"] > 0
    assert quantized["perplexity"] != exact["perplexity"]
    run.update(machine=machine_info(), when="now")
    text = quality_section(run, "dspark bench quality", "quality.png")
    assert "| float32 |" in text and "| int8 |" in text and "100.0% (2/2)" in text
    assert quality_plot(run, tmp_path / "quality.png").stat().st_size > 1000
