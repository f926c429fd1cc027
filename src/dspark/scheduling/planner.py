"""The confidence schedulers (docs/design.md §5): how many draft tokens each request verifies, from the drafter's
confidences and the engine's measured cost table. Both implement decoding.policy.VerifyPolicy."""

from __future__ import annotations

from collections import deque
from itertools import accumulate

import torch

from dspark.decoding.policy import BasePolicy, prefix_survival
from dspark.scheduling.calibration import drafter_temperatures, read_temperatures
from dspark.scheduling.profile import CostTable


class PrefixScheduler(BasePolicy):
    """Confidence-scheduled verification, Algorithm 1 of the paper (docs/design.md §5).

    Candidates (request r, position j) are taken in order of prefix survival a_{r,j} = Π_{i<=j} c_{r,i}. Starting
    from ℓ = 0 for every request (B = R tokens, τ = R), each admission sets ℓ_r = j, B += 1, τ += a_{r,j}, and is
    kept while Θ = τ · SPS(B) improves, SPS being the cost table's rounds per second for R rows carrying B tokens
    (drafting included where it was profiled; a ragged verify costs the tokens it carries). The search stops at the
    first admission that does not improve Θ: looking further would let the token sampled at j decide whether j is
    verified (Appendix A), which biases the output.

    Before drafting, a round asks whether drafting pays at its batch size: by the survival estimates of the last
    `memory` drafted rounds, would the best verification earn more than the drafter's share of the round costs?
    Where it would not (a loaded server, doubtful drafts), the round verifies its anchors alone, as plain decoding,
    and a round drafts anyway to renew the estimates after `probe_every` rounds, then twice as many while drafting
    keeps not paying, up to `max_probe_gap` (a probe of 64 rows costs about two plain rounds: one in 16 was ~6 % of a
    loaded server's time). A probe's estimates replace the older ones, which describe the text before the pause. The
    question is settled before the round drafts, so its answer cannot depend on what is drafted: lossless.
    """

    def __init__(
        self,
        cost,
        temperatures: list[float] | None = None,
        memory: int = 8,
        probe_every: int = 16,
        max_probe_gap: int = 256,
    ):
        self.cost = cost
        self.temperatures = temperatures
        self.recent: deque[torch.Tensor] = deque(maxlen=memory)  # survival [rows, γ] of the last drafted rounds
        self.probe_every = probe_every
        self.max_probe_gap = max_probe_gap
        self.restart()

    def restart(self) -> None:
        """Requests join an idle engine: the estimates of earlier requests say nothing of theirs (a request whose
        drafts were rejected would stop the next one from drafting for up to `max_probe_gap` rounds), so the first
        round drafts."""
        self.recent.clear()
        self.probe_gap = self.probe_every  # rounds without drafting before the next probe
        self.skipped = 0  # rounds since the last drafted one

    def drafts(self, rows: int) -> bool:
        drafts = self._drafts(rows)
        # Priced now for a round that verifies anchors alone; `lengths` prices a drafted one.
        self.planned_ms = None if drafts else self.cost.round_time(rows, 1.0, drafted=False)
        return drafts

    def _drafts(self, rows: int) -> bool:
        if not self.recent or self.drafting_pays(rows):
            self.skipped, self.probe_gap = 0, self.probe_every
            return True
        if self.skipped + 1 >= self.probe_gap:  # a probe: the rounds before the pause describe an older context
            self.skipped, self.probe_gap = 0, min(2 * self.probe_gap, self.max_probe_gap)
            self.recent.clear()
            return True
        self.skipped += 1
        return False

    def drafting_pays(self, rows: int) -> bool:
        """Whether a round of `rows` rows that drafts and verifies its most likely drafts beats one that verifies
        its anchors alone, in expected tokens per second, the drafts' survival taken from the recent rounds (pooled,
        per row) and verified 1/4 token per row at a time up to γ."""
        pooled = torch.cat(list(self.recent))
        per_row, gamma = pooled.shape
        gains = [0.0, *accumulate(pooled.flatten().sort(descending=True).values.tolist())]
        best = 0.0
        for quarter in range(4 * gamma + 1):
            k = round(quarter * per_row / 4)
            best = max(best, (1 + gains[k] / per_row) * self.cost.rate(rows, 1 + k / per_row))
        return best > self.cost.rate(rows, 1.0, drafted=False)

    def observe(self, confidence_logits: torch.Tensor | None) -> torch.Tensor:
        """This round's survival estimates [B, γ], remembered for `drafts`."""
        survival = prefix_survival(confidence_logits, "scheduler", self.temperatures)
        self.recent.append(survival)
        return survival

    def planned(self, ell: list[int]) -> torch.Tensor:
        """ℓ per request as a tensor, the drafted round's price kept in `planned_ms`."""
        self.planned_ms = self.cost.round_time(len(ell), 1 + sum(ell) / len(ell))
        return torch.tensor(ell, dtype=torch.long)

    def lengths(self, confidence_logits: torch.Tensor | None, gamma: int, batch: int) -> torch.Tensor:
        survival = self.observe(confidence_logits)
        # Within a request survival never grows with j, so this order (stable: ties keep j order) admits prefixes.
        order = torch.sort(-survival.flatten(), stable=True).indices.tolist()
        values = survival.flatten().tolist()
        ell = [0] * batch
        tokens, tau = batch, float(batch)
        best = tau * self.cost.rate(batch, 1.0)
        for idx in order:
            r, j = divmod(idx, gamma)
            if j != ell[r]:
                break  # only reachable through a tie across positions; stopping is always safe
            theta = (tau + values[idx]) * self.cost.rate(batch, (tokens + 1) / batch)
            if theta <= best:
                break
            ell[r], tokens, tau, best = j + 1, tokens + 1, tau + values[idx], theta
        return self.planned(ell)

    def describe(self) -> str:
        return "prefix scheduler" + (" (STS-calibrated)" if self.temperatures else "")


class ProductionScheduler(PrefixScheduler):
    """The paper's production variant (§5.2): a global verify budget K from confidences two steps old, spent on
    the current step's candidates in order of their current survival.

    K is where Θ = τ·SPS(B) peaks over all admissions in survival order (a global argmax, which copes with jagged
    cost curves where Algorithm 1's early stop would end too soon), computed from each step's confidences and used
    two steps later. The candidates taken now are the top K by current survival; whether (r, j) is among them
    depends on a_{r,j} and on other requests, never on a_{r,j+1} (it ranks below a_{r,j}), so the token drafted at
    j cannot decide whether j is verified: lossless, like Algorithm 1."""

    def __init__(
        self,
        cost,
        temperatures: list[float] | None = None,
        delay: int = 2,
        memory: int = 8,
        probe_every: int = 16,
        max_probe_gap: int = 256,
    ):
        super().__init__(cost, temperatures, memory, probe_every, max_probe_gap)
        self.delay = delay

    def restart(self) -> None:
        super().restart()
        self.budgets: list[int] = []

    def budget(self, survival: torch.Tensor) -> int:
        """Draft tokens worth verifying for these survival values: the global argmax of Θ."""
        batch = survival.shape[0]
        values = survival.flatten().sort(descending=True).values.tolist()
        tau, best, best_k = float(batch), batch * self.cost.rate(batch, 1.0), 0
        for k, a in enumerate(values, 1):
            tau += a
            theta = tau * self.cost.rate(batch, (batch + k) / batch)
            if theta > best:
                best, best_k = theta, k
        return best_k

    def lengths(self, confidence_logits: torch.Tensor | None, gamma: int, batch: int) -> torch.Tensor:
        survival = self.observe(confidence_logits)
        self.budgets.append(self.budget(survival))
        # Until two steps have been seen, verify one draft per request.
        budget = self.budgets.pop(0) if len(self.budgets) > self.delay else batch
        order = torch.sort(-survival.flatten(), stable=True).indices[: min(budget, survival.numel())].tolist()
        ell = [0] * batch
        for idx in sorted(order, key=lambda i: i % gamma):  # prefixes first: position j after position j-1
            r, j = divmod(idx, gamma)
            if j == ell[r]:
                ell[r] = j + 1
        return self.planned(ell)

    def describe(self) -> str:
        return f"production scheduler (budget from {self.delay} steps back)"


SCHEDULERS = {"algorithm1": PrefixScheduler, "production": ProductionScheduler}


def build_scheduler(
    target,
    drafter_path,
    cost_table: str | None = None,
    calibration: str | None = None,
    kind: str = "algorithm1",
    batch_sizes: tuple[int, ...] = (1,),
    drafter=None,
):
    """A confidence scheduler with the given cost table (else this machine's for this target and the drafter's
    shape, profiled once and cached; servers pass `batch_sizes` so that it knows the cost of a batch's shape) and
    the given STS calibration (else the one shipped beside the drafter; uncalibrated confidences when it has none).
    `drafter`: the loaded drafter at `drafter_path`, when the caller has it."""
    from dspark.autotune import cached_cost_table
    from dspark.drafter import checkpoint_of, load_drafter

    checkpoint = checkpoint_of(drafter_path)  # None for suffix decoding alone, which has no calibration
    if cost_table:
        cost = CostTable.load(cost_table)
    else:
        if drafter is None:
            drafter = load_drafter(checkpoint, target)
        cost = cached_cost_table(target, batch_sizes=batch_sizes, drafter=drafter)
    temps: list[float] | None = None
    if calibration:
        temps = read_temperatures(calibration)
    elif checkpoint is not None:
        temps = drafter_temperatures(checkpoint)
    return SCHEDULERS[kind](cost, temps)
