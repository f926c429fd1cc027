"""Machine tuning, in one place and run only when asked (`dspark autotune`, or the commands that load a target for
decoding, once per machine): what this CPU can do, which precision the target runs fastest in (`--dtype auto`), in
which form its matrix products run (packed weights, a quantized target's prompts), and
the cost table the scheduler plans with. Every decision is timed on the real forward once per machine, target,
precision, thread count and revision of dspark's code (`models.code_revision`: an upgrade re-measures) and kept in
the dspark cache (`~/.cache/dspark`); loading a model never measures anything.

bfloat16 halves the bytes every step streams, but only CPUs with native bfloat16 arithmetic (AMX or AVX-512-BF16)
compute it fast; elsewhere it is emulated. Which precision is fastest is measured, never guessed from the flags (on
a 2-core AVX2-only EPYC, int4 with bfloat16 activations ran a step 3x faster than float32). Every precision runs
batch-invariant on a CPU (decoder.py), so speculative output equals plain output token for token in it; since that
rests on how the machine's kernels round, `--dtype auto` picks only a precision whose real forward passed the
invariance check here.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from dspark.decoder import PREFILL_FORMS
from dspark.errors import DSparkError
from dspark.fsutil import atomic_write_json
from dspark.models import machine_cache_file, machine_cache_files
from dspark.products import packing_available
from dspark.scheduling.profile import CostTable, profile_target
from dspark.target import Target, load_precision

NATIVE_BF16_FLAGS = ("amx_bf16", "avx512_bf16")
AUTO_PRECISIONS = ("float32", "bfloat16", "int4")  # what `--dtype auto` chooses among
NOT_INVARIANT = (
    "no precision is batch-invariant on this CPU, so float32 runs, and speculative output may differ from plain "
    "output where two tokens nearly tie"
)


@dataclass
class PrecisionChoice:
    dtype: str
    reason: str
    step_ms: dict  # {"float32": {"1": ms, "8": ms}, ...} where measured


_IN_MEMORY: dict[Path, dict] = {}  # records measured in a run whose cache could not be written
_WARNED: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _WARNED:
        _WARNED.add(message)
        print(f"dspark: {message}", file=sys.stderr)


def tuning_record(path: Path, valid, measure) -> dict:
    """The machine's record at `path` in the dspark cache: read where `valid(record)` accepts it, else measured now
    (`measure()` returns it) and kept. The cache is a convenience, never a point of failure: a damaged record is
    measured again after one warning naming the file, and where the cache cannot be written the record is kept in
    memory for this run, after one line on DSPARK_CACHE."""
    if path in _IN_MEMORY:
        return _IN_MEMORY[path]
    if path.exists() or path.is_symlink():
        try:
            record = json.loads(path.read_text(encoding="utf-8"))
            if isinstance(record, dict) and valid(record):
                return record
            problem = "not a record of this kind"
        except (OSError, ValueError) as e:
            problem = getattr(e, "strerror", None) or type(e).__name__
        _warn_once(f"ignoring the damaged tuning record {path} ({problem}); measuring again")
    record = measure()
    try:
        atomic_write_json(path, record)
    except OSError as e:
        _IN_MEMORY[path] = record
        _warn_once(
            f"cannot write the dspark cache ({path.parent}: {e.strerror}); measurements are kept for this run only. "
            "Set DSPARK_CACHE to a writable folder to keep them"
        )
    return record


def _flag(record: dict, key: str) -> bool:
    return isinstance(record.get(key), bool)


def cpu_name() -> str:
    try:
        return next(
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().split("\n")
            if line.startswith("model name")
        )
    except (OSError, StopIteration):
        import platform

        return platform.processor() or "unknown"


def cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().split("\n"):
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def native_bf16_flags() -> list[str]:
    """This CPU's flags for native bfloat16 arithmetic; empty where bfloat16 is emulated."""
    flags = cpu_flags()
    return sorted(f for f in NATIVE_BF16_FLAGS if f in flags)


def choose_precision(model: str, load) -> PrecisionChoice:
    """The precision for `model` on this machine; `load(precision)` returns a Target (only called when measuring).
    Among the precisions that keep the model's weights (Target.keeps_weights: float32, bfloat16, and int4 where the
    weights come from a 4-bit file of its layout), the one whose 1-token step plus 8-token verify is cheapest here and
    whose forward is batch-invariant here (`invariance_failures`, on the real forward, checked fastest first), so that
    speculative output equals plain output by construction. Measured on every CPU: which is fastest depends on more
    than its flags (bfloat16 is emulated without AMX or AVX-512-BF16, yet int4's bfloat16 kernel or a slow float32
    BLAS can still win). int8, and int4 that would round the weights, change the model; they are run only when asked
    for (`dspark bench quality` measures how far each precision stays from float32)."""

    def valid(record: dict) -> bool:
        return (
            record.get("dtype") in AUTO_PRECISIONS
            and isinstance(record.get("reason"), str)
            and isinstance(record.get("step_ms"), dict)
            and set(record) == {"dtype", "reason", "step_ms"}
        )

    record = tuning_record(machine_cache_file("precision", model), valid, lambda: asdict(measure_precision(load)))
    return PrecisionChoice(**record)


def measure_precision(load) -> PrecisionChoice:
    """choose_precision's measurement: every precision that keeps the weights timed, fastest invariant one chosen."""
    targets = {precision: load(precision) for precision in AUTO_PRECISIONS}
    rounded = [precision for precision, target in targets.items() if not target.keeps_weights]
    times = {p: {"1": float("inf"), "8": float("inf")} for p in targets if p not in rounded}
    for _ in range(3):  # interleaved, the best of each kept: load from elsewhere slows all alike (the choice is cached)
        for precision in times:
            table = profile_target(targets[precision], token_counts=(1, 8), context=128, repeats=3)
            for n, ms in zip(table.token_counts, table.step_time_ms):
                times[precision][str(n)] = min(times[precision][str(n)], ms)
    by_cost = sorted(times, key=lambda p: times[p]["1"] + times[p]["8"])
    varying = []
    for precision in by_cost:
        if not invariance_failures(targets[precision]):
            break
        varying.append(precision)
    dtype = next((p for p in by_cost if p not in varying), "float32")  # see NOT_INVARIANT
    native = native_bf16_flags()
    flags = f"this CPU has {'/'.join(native)}" if native else "this CPU has no native bfloat16 (no AMX / AVX-512-BF16)"
    steps = ", ".join(f"{p} {times[p]['1']:.1f} + {times[p]['8']:.1f} ms" for p in by_cost)
    reason = f"{flags}; measured here, a 1-token step plus an 8-token verify took {steps}"
    if rounded:
        reason += f" ({', '.join(rounded)} left out: it would round this model's weights; --dtype asks for it)"
    if varying:
        reason += f" ({', '.join(varying)} left out: not batch-invariant on this CPU)"
    if dtype in varying:
        reason += f"; {NOT_INVARIANT}"
    return PrecisionChoice(dtype, reason, times)


@torch.no_grad()
def invariance_failures(
    target, prompt_len: int = 200, steps: int = 12, seed: int = 0, ragged: bool = True
) -> list[str]:
    """Rows whose logits differ bitwise between a 1-token step, the same tokens inside verify blocks of 2-12, and
    (ragged) the same block inside a ragged batch of two rows; [] where the forward is batch-invariant on this
    machine. The kernels' rounding depends on the CPU and its BLAS library, so `choose_precision` runs this on the
    real target before `auto` may pick a precision (seconds, once per machine)."""
    g = torch.Generator().manual_seed(seed)
    vocab = min(target.vocab_size, 5000)
    prompt = torch.randint(0, vocab, (1, prompt_len), generator=g)
    other = torch.randint(0, vocab, (1, prompt_len), generator=g)
    new = torch.randint(0, vocab, (1, steps), generator=g)
    cache = target.new_cache(1)
    target.prefill(cache, prompt)
    block = target.forward(cache, new).logits[0]
    cache.rollback(cache.lengths - steps)
    failures = [
        f"step {j}"
        for j in range(steps)
        if not torch.equal(target.forward(cache, new[:, j : j + 1]).logits[0, 0], block[j])
    ]
    for width in (2, 4, 8):  # the same tokens in shorter blocks
        cache.rollback(cache.lengths - steps)
        for start in range(0, steps - width + 1, width):
            part = target.forward(cache, new[:, start : start + width]).logits[0]
            failures += [f"block {width} row {j}" for j in range(width) if not torch.equal(part[j], block[start + j])]
    if not ragged:
        return failures
    batch = target.new_cache(2)
    target.prefill(batch, torch.cat([prompt, other]), torch.tensor([prompt_len, prompt_len - 63]))
    out = target.forward(batch, torch.cat([new[:, :8], new[:, 4:12]]), torch.tensor([8, 3])).logits[0]
    return failures + [f"ragged row {j}" for j in range(8) if not torch.equal(out[j], block[j])]


def time_forms(target: Target, forms: dict, widths: tuple[int, ...], repeats: int = 3) -> dict:
    """Seconds of the fastest pass of forwards of `widths` new tokens after a 64-token prompt, per form (`forms`: a
    name and how to switch the target to it), the forms interleaved and the best of repeats + 1 passes kept: robust
    to other work on the machine."""
    cache = target.new_cache(1)
    # Its own generator: loading a model must not move the caller's random state (a seeded training run).
    ids = torch.randint(0, min(target.vocab_size, 5000), (1, 72), generator=torch.Generator().manual_seed(0))
    target.prefill(cache, ids[:, :64])
    best = {form: float("inf") for form in forms}
    for _ in range(repeats + 1):
        for form, apply in forms.items():
            apply()
            start = time.perf_counter()
            for n in widths:
                target.forward(cache, ids[:, 64 : 64 + n])
                cache.rollback(cache.lengths - n)
            best[form] = min(best[form], time.perf_counter() - start)
    return best


def clearly_faster(target: Target, forms: dict, form: str, than: str, repeats: int) -> tuple[bool, dict]:
    """Whether `form` takes a 1-token step plus an 8-token verify at least 5 % faster than `than` (both timed in
    `forms`, as time_forms takes them), and the timings in ms for the machine's record. A new form pays in the
    verify, and its step may be a near tie. The sum, not each width alone: a rule that also asked the step to be no
    slower flipped between runs on a busy machine where the float16 head's step was level (2-core AVX2-only EPYC:
    steps 26.5-28.7 ms in both forms, verifies 46-49 against 64-67)."""
    step, verify = time_forms(target, forms, (1,), repeats), time_forms(target, forms, (8,), repeats)
    timings = {
        "step_ms": {k: round(1000 * v, 2) for k, v in step.items()},
        "verify_8_ms": {k: round(1000 * v, 2) for k, v in verify.items()},
    }
    return step[form] + verify[form] < 0.95 * (step[than] + verify[than]), timings


def choose_product_forms(target: Target, repeats: int = 3) -> Target:
    """Run the products in the form that is faster on this machine: where oneDNN runs the precision, packed weights
    or not (products.PackedWeight). Real forwards of 1 and 8 new tokens are timed in each form once per machine,
    precision and thread count (a few seconds), then read from the dspark cache."""
    path = machine_cache_file("kernels", target.name, target.precision)
    record = tuning_record(
        path,
        lambda r: _flag(r, "packed"),
        lambda: measure_product_forms(target, repeats),
    )
    return target.use_packed_weights(record["packed"])


def measure_product_forms(target: Target, repeats: int) -> dict:
    """choose_product_forms' measurement: the record of the forms timed on this machine."""

    verify = time_forms(target, {"linear": lambda: None}, (4, 8), repeats)
    # Only where the products dominate (the real 135M target: 350 ms here; a tiny test model: 5 ms, mostly Python):
    # below that the timings are noise, and a coin-flip choice would make otherwise identical runs differ in
    # their last bits.
    real = verify["linear"] > 0.05
    record = {"packed": False, "verify_4_and_8_ms": {k: round(1000 * v, 2) for k, v in verify.items()}}
    if real and packing_available(target.lm_head.weight):
        forms = {"plain": lambda: target.use_packed_weights(False), "packed": lambda: target.use_packed_weights(True)}
        record["packed"], timings = clearly_faster(target, forms, "packed", "plain", repeats)
        record.update(timings)
    return record


def cached_cost_table(
    target,
    token_counts=(1, 2, 3, 4, 5, 6, 7, 8),
    repeats: int = 5,
    batch_sizes: tuple[int, ...] = (1,),
    drafter=None,
) -> CostTable:
    """This machine's cost table for this target, precision and thread count, at these batch sizes (several: a grid
    of batch shapes, which the schedulers then plan with), with the drafting time of `drafter`'s architecture where
    given: profiled once (seconds; a minute for a server's grid), then read from the dspark cache."""
    # The product forms, the batch sizes and the drafter's shape are part of the key: a table measured otherwise
    # would not fit.
    form = "packed" if target.decoder.packed else "plain"
    form += "-compiled" if target.decoder.compiled is not None else ""
    rows = [] if tuple(batch_sizes) == (1,) else ["rows" + "_".join(map(str, batch_sizes))]
    drafting = [] if drafter is None else ["draft" + drafter_shape_key(drafter)]
    path = machine_cache_file("costs", target.name, target.precision, form, *rows, *drafting)

    def valid(record: dict) -> bool:
        try:
            CostTable.from_record(record, path)
        except DSparkError:
            return False
        return True

    def measure() -> dict:
        table = profile_target(target, token_counts, repeats=repeats, batch_sizes=batch_sizes, drafter=drafter)
        return table.record()

    return CostTable.from_record(tuning_record(path, valid, measure), path)


def drafter_shape_key(drafter) -> str:
    """A short key for what a drafter's time depends on: its configuration, not its weights."""
    import hashlib
    import json
    from dataclasses import asdict, is_dataclass

    config = getattr(drafter, "config", None)
    spec = asdict(config) if is_dataclass(config) else {"kind": type(drafter).__name__, "gamma": drafter.block_size}
    return hashlib.sha1(json.dumps(spec, sort_keys=True, default=str).encode()).hexdigest()[:10]


def choose_prefill_form(target: Target, prompt_len: int = 128, repeats: int = 2) -> Target:
    """Read prompts of a quantized target in the form that is fastest on this machine (decoder.PREFILL_FORMS: its
    bfloat16 matrices, float32 copies of them, or its quantized kernels): a prompt is timed in each form, interleaved,
    once per machine, precision and thread count, then read from the dspark cache."""
    decoder = target.decoder
    path = machine_cache_file("kernels", target.name, target.precision, "prefill")
    record = tuning_record(
        path,
        lambda r: r.get("prefill_form") in PREFILL_FORMS,
        lambda: measure_prefill_form(target, prompt_len, repeats),
    )
    decoder.use_prefill_form(record["prefill_form"])
    return target


def measure_prefill_form(target: Target, prompt_len: int, repeats: int) -> dict:
    """choose_prefill_form's measurement: a prompt timed in each form, interleaved."""
    decoder = target.decoder
    ids = torch.randint(0, min(target.vocab_size, 5000), (1, prompt_len), generator=torch.Generator().manual_seed(0))
    best = {form: float("inf") for form in PREFILL_FORMS}
    for _ in range(repeats):
        for form in PREFILL_FORMS:
            decoder.use_prefill_form(form)
            start = time.perf_counter()
            target.prefill(target.new_cache(1), ids)
            best[form] = min(best[form], time.perf_counter() - start)
    # Another form only where it is clearly faster on a prompt long enough to time (not a tiny test model's): a
    # coin-flip choice would make otherwise identical runs differ in their last bits.
    fastest = min(best, key=best.get)
    form = fastest if best["bfloat16"] > 0.05 and best[fastest] < 0.85 * best["bfloat16"] else "bfloat16"
    return {"prefill_form": form, "prompt_ms": {k: round(1000 * v, 1) for k, v in best.items()}}


TIMED_HEAD_WEIGHTS = 1 << 22  # an LM head smaller than this is not timed: it keeps its form


def choose_head_form(target: Target, repeats: int = 3) -> Target:
    """The LM head as FBGEMM's float16 weights (LMHead.use_float16) where that is clearly faster on this machine
    (clearly_faster): forwards timed in both forms once per machine, precision and thread count, then read from the
    dspark cache. Targets that cannot take it keep their head."""
    # A head too small to time (a tiny test model's) keeps its form: a coin-flip choice would make otherwise identical
    # runs differ in their last bits.
    if not target.head.float16_possible() or target.lm_head.weight.numel() < TIMED_HEAD_WEIGHTS:
        return target
    path = machine_cache_file("kernels", target.name, target.precision, "head")

    def measure() -> dict:
        forms = {"model": lambda: target.head.use_float16(False), "float16": lambda: target.head.use_float16(True)}
        chosen, timings = clearly_faster(target, forms, "float16", "model", repeats)
        return {"float16_head": chosen, **timings}

    target.head.use_float16(tuning_record(path, lambda r: _flag(r, "float16_head"), measure)["float16_head"])
    return target


def tune(target: Target) -> Target:
    """The target in this machine's fastest product forms (measured the first time, then read from the cache)."""
    if target.device.type != "cpu":
        return target
    return choose_head_form(choose_prefill_form(target) if target.quantized else choose_product_forms(target))


def autotune(model: str, force: bool = False, progress=print) -> dict:
    """Every decision for `model` on this machine, measured now where missing (all of them with `force`)."""
    if force:
        for kind in ("precision", "kernels", "costs"):
            for path in machine_cache_files(kind, model):
                path.unlink()
    loaded = {}

    def load(dtype: str) -> Target:
        if dtype not in loaded:
            progress(f"dspark: timing {model} in {dtype}")
            loaded[dtype] = tune(load_precision(model, dtype))
        return loaded[dtype]

    choice = choose_precision(model, load)
    target = load(choice.dtype)
    table = cached_cost_table(target)
    return {
        "machine": {"cpu": cpu_name(), "native_bfloat16": native_bf16_flags(), "threads": torch.get_num_threads()},
        "precision": asdict(choice),
        "batch_invariant": target.decoder.batch_invariant,
        "product_forms": {
            "packed": target.decoder.packed,
            "prefill": target.decoder.prefill_form,
            "float16_head": target.head.form_name == "float16",
        },
        "cost_table_ms": dict(zip(table.token_counts, table.step_time_ms)),
    }
