"""The cost table: how long a round takes as a function of the tokens it verifies (docs/design.md §5).

SPS(B) = target steps per second when the verify forward carries B tokens in total (bonus slots included),
profiled once per engine, machine and precision. Where a drafter was profiled with it, its share of a round
(proposing γ tokens, then reading the accepted tokens' features) is kept per batch size in `meta["draft"]` and added
to every round's time: it is paid whatever the round verifies, so a scheduler that left it out would undervalue
verification. Stored in the interchange format TensorRT-LLM and SGLang read:
{"token_counts": [...], "step_time_ms": [...], ...}. Where it was profiled at several batch sizes, its grid (rows ×
tokens per row, in `meta["grid"]`) also gives the cost of a batch's shape: R rows carrying B tokens in all cost what
R rows of B/R tokens each do, since a ragged forward multiplies only its real tokens.
"""

from __future__ import annotations

import math
import numbers
import time
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import torch

from dspark.errors import DSparkError
from dspark.fsutil import atomic_write_json, read_json


@dataclass
class CostTable:
    token_counts: list[int]
    step_time_ms: list[float]
    meta: dict = field(default_factory=dict)

    def __post_init__(self):
        if (
            not isinstance(self.token_counts, (list, tuple))
            or not isinstance(self.step_time_ms, (list, tuple))
            or not self.token_counts
            or len(self.token_counts) != len(self.step_time_ms)
        ):
            raise DSparkError("a cost table needs matching, non-empty lists token_counts and step_time_ms")
        if not all(_count(n) for n in self.token_counts):
            raise DSparkError("a cost table's token_counts must be positive whole numbers")
        if not all(_milliseconds(t, positive=True) for t in self.step_time_ms):
            raise DSparkError("a cost table's step_time_ms must be finite, positive milliseconds")
        if not isinstance(self.meta, dict):
            raise DSparkError("a cost table's extra fields must form a JSON object")
        for key, fields in (("grid", ("batch_size", "tokens_per_row")), ("draft", ("batch_size",))):
            rows = self.meta.get(key, [])
            if not isinstance(rows, list) or not all(
                isinstance(r, dict) and all(_count(r.get(f)) for f in fields) and _milliseconds(r.get("ms"))
                for r in rows
            ):
                raise DSparkError(
                    f"a cost table's {key} must be a list of {{{', '.join(fields)}, ms}} with whole counts and finite, "
                    "non-negative ms"
                )
        pairs = sorted(zip(self.token_counts, self.step_time_ms))
        self.token_counts = [int(n) for n, _ in pairs]
        self.step_time_ms = [float(t) for _, t in pairs]

    def step_time(self, tokens: float) -> float:
        """Milliseconds for a forward over `tokens` tokens: linear between profiled counts, flat below the smallest,
        proportional beyond the largest."""
        xs, ys = self.token_counts, self.step_time_ms
        if tokens <= xs[0]:
            return ys[0]
        if tokens >= xs[-1]:
            return ys[-1] * tokens / xs[-1]  # beyond the table: proportional (compute bound)
        for (x0, y0), (x1, y1) in zip(zip(xs, ys), zip(xs[1:], ys[1:])):
            if x0 <= tokens <= x1:
                return y0 + (y1 - y0) * (tokens - x0) / (x1 - x0)
        return ys[-1]

    @cached_property
    def has_shapes(self) -> bool:
        """Whether the grid covers more than one batch size (else only the total-token curve is known)."""
        return len({g["batch_size"] for g in self.meta.get("grid", [])}) > 1

    @cached_property
    def _width_curves(self) -> dict[int, CostTable]:
        """Per profiled batch size, the forward's time against tokens per row, fitted never to fall (fit_monotone).
        Not a line: quantized kernels cost in steps (int4 on a CPU: 2, 3 and 4 tokens a row cost about alike, 5 a
        step more), and a line through them priced the third and fourth draft 2-4 ms too high at one row."""
        by_rows: dict[int, list[tuple[int, float]]] = {}
        for g in self.meta["grid"]:
            by_rows.setdefault(int(g["batch_size"]), []).append((int(g["tokens_per_row"]), float(g["ms"])))
        curves = {size: fit_monotone(points) for size, points in by_rows.items()}
        return {size: CostTable([w for w, _ in fit], [ms for _, ms in fit]) for size, fit in curves.items()}

    @cached_property
    def _draft_curve(self) -> CostTable | None:
        points = [(int(d["batch_size"]), float(d["ms"])) for d in self.meta.get("draft", [])]
        return CostTable([b for b, _ in points], [ms for _, ms in points]) if points else None

    def shape_time(self, rows: int, width: float) -> float:
        """Milliseconds for a forward of `rows` rows carrying `width` tokens each: the fitted curve in width at each
        profiled batch size (linear between its points, proportional beyond the widest), then linear in rows
        between batch sizes (proportional beyond the largest, like step_time)."""
        curves = self._width_curves
        sizes = sorted(curves)

        def at(size: int) -> float:
            return curves[size].step_time(width)

        if rows <= sizes[0]:
            return at(sizes[0])
        if rows >= sizes[-1]:
            return at(sizes[-1]) * rows / sizes[-1]
        lo = max(s for s in sizes if s <= rows)
        hi = min(s for s in sizes if s >= rows)
        return at(lo) if lo == hi else at(lo) + (at(hi) - at(lo)) * (rows - lo) / (hi - lo)

    def draft_time(self, rows: int) -> float:
        """Milliseconds of the drafter's share of a round of `rows` rows (0 where no drafter was profiled)."""
        return self._draft_curve.step_time(rows) if self._draft_curve is not None else 0.0

    def round_time(self, rows: int, width: float, drafted: bool = True) -> float:
        """Milliseconds of a round of `rows` rows verifying `width` tokens per row (fractional: a ragged batch's
        mean), drafting included unless the round does not draft: from the batch's shape where the grid knows
        shapes, else the total-token curve."""
        verify = self.shape_time(rows, width) if self.has_shapes else self.step_time(rows * width)
        return verify + (self.draft_time(rows) if drafted else 0.0)

    def rate(self, rows: int, width: float, drafted: bool = True) -> float:
        """Rounds per second of `rows` rows verifying `width` tokens per row."""
        return 1000.0 / self.round_time(rows, width, drafted)

    def record(self) -> dict:
        return {"token_counts": self.token_counts, "step_time_ms": self.step_time_ms, **self.meta}

    def save(self, path: str | Path) -> None:
        atomic_write_json(path, self.record())

    @classmethod
    def load(cls, path: str | Path) -> CostTable:
        return cls.from_record(read_json(path, "cost table", "make one with `dspark profile`"), path)

    @classmethod
    def from_record(cls, data, path: str | Path) -> CostTable:
        """The table a JSON record holds, checked field by field; anything else is one line naming `path`."""
        if not isinstance(data, dict) or "token_counts" not in data or "step_time_ms" not in data:
            raise DSparkError(f"{path} is not a cost table (needs token_counts and step_time_ms)")
        meta = {k: v for k, v in data.items() if k not in ("token_counts", "step_time_ms")}
        try:
            return cls(data["token_counts"], data["step_time_ms"], meta)
        except DSparkError as e:
            raise DSparkError(f"{path}: {e}; make one with `dspark profile`") from e


def _count(n) -> bool:
    return isinstance(n, numbers.Integral) and not isinstance(n, bool) and n > 0


def _milliseconds(t, positive: bool = False) -> bool:
    ok = isinstance(t, numbers.Real) and not isinstance(t, bool) and math.isfinite(t)
    return ok and (t > 0 if positive else t >= 0)


def fit_monotone(points: list[tuple[int, float]]) -> list[tuple[int, float]]:
    """The closest non-decreasing curve (least squares) through (x, ms) points, sorted by x: pool-adjacent-violators.
    A forward never gets cheaper with more tokens, so a point that falls below an earlier one is noise, pooled with
    it; single timings on a shared CPU are noisy (a point 37 % high was seen) and the schedulers decide on the
    differences between widths."""
    ordered = sorted(points)
    pools: list[tuple[float, int]] = []  # (mean, count) per pooled run of points
    for _, y in ordered:
        pools.append((y, 1))
        while len(pools) > 1 and pools[-2][0] > pools[-1][0]:
            (y2, n2), (y1, n1) = pools.pop(), pools.pop()
            pools.append(((y1 * n1 + y2 * n2) / (n1 + n2), n1 + n2))
    fitted = [y for y, n in pools for _ in range(n)]
    return [(x, y) for (x, _), y in zip(ordered, fitted)]


def batch_sizes_up_to(rows: int) -> tuple[int, ...]:
    """The batch sizes profiled for a server of at most `rows` rows a round: powers of two to 64, capped at `rows`."""
    return tuple(sorted({min(n, rows) for n in (1, 2, 4, 8, 16, 32, 64)}))


def interleaved_median_ms(runs: dict, repeats: int) -> dict:
    """Median wall time of each of `runs` ({key: callable}) in milliseconds, over `repeats` passes that call each
    once in turn, after one warm-up pass. Interleaved, a stretch of load from elsewhere slows every measurement
    alike instead of one of them: the schedulers decide on their differences."""
    samples: dict = {key: [] for key in runs}
    for attempt in range(repeats + 1):
        for key, run in runs.items():
            start = time.perf_counter()
            run()
            if attempt:
                samples[key].append(time.perf_counter() - start)
    return {key: round(1000 * sorted(times)[len(times) // 2], 3) for key, times in samples.items()}


@torch.no_grad()
def profile_target(
    target,
    token_counts=(1, 2, 3, 4, 5, 6, 8, 12, 16),
    context: int = 256,
    repeats: int = 7,
    batch_sizes=(1,),
    drafter=None,
) -> CostTable:
    """Median time of the engine's verify forward (logits and drafter features) over n new tokens per row on a cache
    of rows up to `context` tokens long, of different lengths as in serving (rolled back after each), for each
    batch size; with a drafter, also its share of a round at each batch size. The table is indexed by the tokens a
    forward carries in total (batch x tokens per row); every measurement is kept in meta["grid"] (and
    meta["draft"])."""
    from dspark.sampling import SamplingParams

    grid, by_total, draft = [], {}, []
    layer_ids = list(drafter.target_layer_ids) if drafter is not None else True
    for batch in batch_sizes:
        cache = target.new_cache(batch)
        ids = torch.randint(0, min(target.vocab_size, 5000), (batch, context + max(token_counts)), device=target.device)
        # Rows of different lengths, as continuous batching makes them: measured on the real target at 4 and 8 rows,
        # rows of one length cost 20-22 % less a round, which made drafting look dearer than it is.
        spread = max(1, min(128, context // 2))
        lengths = torch.tensor([context - (37 * row) % spread for row in range(batch)], device=target.device)
        out = target.prefill(cache, ids[:, :context], lengths, features=layer_ids)
        runs: dict = {}
        for n in token_counts:

            def verify(n=n):
                target.forward(cache, ids[:, context : context + n], features=layer_ids)
                cache.rollback(cache.lengths - n)

            runs[n] = verify
        if drafter is not None:
            # A round's drafting: propose γ tokens, then read two accepted tokens' features (the context grows by
            # two per repeat, as in decoding).
            dcache = drafter.new_cache(batch)
            drafter.extend_context(dcache, out.features, lengths, ids[:, 1 : context + 1])
            two = torch.full((batch,), 2)
            last_two = out.features[:, -2:] if out.features is not None else None  # none: a proposer of tokens only

            def round_share():
                drafter.propose(dcache, ids[:, context], SamplingParams())
                drafter.extend_context(dcache, last_two, two, ids[:, context - 1 : context + 1])

            runs["draft"] = round_share
        measured = interleaved_median_ms(runs, repeats)
        for n in token_counts:
            grid.append({"batch_size": batch, "tokens_per_row": n, "ms": measured[n]})
            by_total.setdefault(batch * n, []).append(measured[n])
        if drafter is not None:
            draft.append({"batch_size": batch, "ms": measured["draft"]})
    totals = sorted(by_total)
    meta = {
        "dtype": str(target.dtype).replace("torch.", ""),
        "context": context,
        "grid": grid,
        "threads": torch.get_num_threads(),
        "target": target.name,
    }
    if draft:
        meta["draft"] = draft
    return CostTable(totals, [round(sum(by_total[t]) / len(by_total[t]), 3) for t in totals], meta)
