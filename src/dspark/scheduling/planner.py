"""The prefix scheduler (docs/design.md §5, the paper's Algorithm 1): how many draft tokens each request verifies,
from the drafter's confidences and the engine's measured cost table."""

from __future__ import annotations

import torch

from dspark.decoding.policy import confidences
from dspark.scheduling.calibration import drafter_temperatures, read_temperatures
from dspark.scheduling.profile import CostTable, cached_cost_table


class PrefixScheduler:
    """Confidence-scheduled verification, Algorithm 1 of the paper (docs/design.md §5).

    Candidates (request r, position j) are taken in order of prefix survival a_{r,j} = Π_{i<=j} c_{r,i}. Starting
    from ℓ = 0 for every request (B = R tokens, τ = R), each admission sets ℓ_r = j, B += 1, τ += a_{r,j}, and is
    kept while Θ = τ · SPS(B) improves. The search stops at the first admission that does not improve Θ: looking
    further would let the token sampled at j decide whether j is verified (Appendix A), which biases the output.
    """

    def __init__(self, cost, temperatures: list[float] | None = None):
        self.cost = cost
        self.temperatures = temperatures

    def lengths(self, confidence_logits: torch.Tensor | None, gamma: int, batch: int) -> torch.Tensor:
        survival = confidences(confidence_logits, "scheduler", self.temperatures).float().cumprod(dim=1)
        # Within a request survival never grows with j, so this order (stable: ties keep j order) admits prefixes.
        order = torch.sort(-survival.flatten(), stable=True).indices.tolist()
        values = survival.flatten().tolist()
        ell = [0] * batch
        tokens, tau = batch, float(batch)
        best = tau * self.cost.sps(tokens)
        for idx in order:
            r, j = divmod(idx, gamma)
            if j != ell[r]:
                break  # only reachable through a tie across positions; stopping is always safe
            theta = (tau + values[idx]) * self.cost.sps(tokens + 1)
            if theta <= best:
                break
            ell[r], tokens, tau, best = j + 1, tokens + 1, tau + values[idx], theta
        return torch.tensor(ell, dtype=torch.long)

    def describe(self) -> str:
        return "prefix scheduler" + (" (STS-calibrated)" if self.temperatures else "")


def build_scheduler(target, drafter_path, cost_table: str | None = None, calibration: str | None = None) -> PrefixScheduler:
    """The prefix scheduler with the given cost table (else this machine's, profiled once and cached) and the given
    STS calibration (else the one shipped beside the drafter; uncalibrated confidences when it has none)."""
    cost = CostTable.load(cost_table) if cost_table else cached_cost_table(target)
    temps = read_temperatures(calibration) if calibration else drafter_temperatures(drafter_path)
    return PrefixScheduler(cost, temps)
