"""Which precision the target runs in on this machine, when the user does not say (`--dtype auto`).

bfloat16 halves the bytes every step streams, but only CPUs with native bfloat16 arithmetic (AMX or AVX-512-BF16)
compute it fast; elsewhere it is emulated and slower than float32. Where the CPU has it, both precisions are timed
on the real forward (one token, the plain step; eight tokens, a verify) and the faster one wins. The decision is
cached per machine, target and thread count, like the cost table. float32 is the precision in which speculative
output is token-for-token identical to plain decoding; bfloat16 output is reported, not guaranteed, identical.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from dspark.fsutil import atomic_write_json
from dspark.models import machine_cache_file
from dspark.scheduling.profile import profile_target

NATIVE_BF16_FLAGS = ("amx_bf16", "avx512_bf16")


@dataclass
class PrecisionChoice:
    dtype: str
    reason: str
    step_ms: dict  # {"float32": {"1": ms, "8": ms}, ...} where measured


def cpu_name() -> str:
    try:
        return next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().split("\n")
                    if line.startswith("model name"))
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
    """This CPU's flags for native bfloat16 arithmetic; empty where bfloat16 is emulated (and slower than float32)."""
    flags = cpu_flags()
    return sorted(f for f in NATIVE_BF16_FLAGS if f in flags)


def choose_precision(model: str, load) -> PrecisionChoice:
    """The precision for `model` on this machine; `load(dtype)` returns a Target (only called when measuring)."""
    native = native_bf16_flags()
    if not native:
        return PrecisionChoice("float32", "this CPU has no native bfloat16 (no AMX / AVX-512-BF16), so float32 is "
                                          "faster", {})
    path = machine_cache_file("precision", model)
    if path.exists():
        return PrecisionChoice(**json.loads(path.read_text()))
    times = {}
    for dtype in ("float32", "bfloat16"):
        table = profile_target(load(dtype), token_counts=(1, 8), context=128, repeats=5)
        times[dtype] = {str(n): ms for n, ms in zip(table.token_counts, table.step_time_ms)}
    cost = {dtype: t["1"] + t["8"] for dtype, t in times.items()}
    dtype = min(cost, key=cost.get)
    bf, fp = times["bfloat16"], times["float32"]
    reason = (f"this CPU has {'/'.join(native)}; measured here, a 1-token step took {bf['1']:.1f} ms in bfloat16 vs "
              f"{fp['1']:.1f} ms in float32, an 8-token verify {bf['8']:.1f} vs {fp['8']:.1f} ms")
    choice = PrecisionChoice(dtype, reason, times)
    atomic_write_json(path, asdict(choice))
    return choice
