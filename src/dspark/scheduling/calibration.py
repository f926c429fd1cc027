"""Confidence calibration by Sequential Temperature Scaling (docs/design.md §5), and its quality measures.

Rounds of real decoding give, per draft position k, the confidence logit and whether the prefix 1..k survived.
For k = 1..γ in order, T_k is grid-searched so that the survival estimate Π_{i<=k} σ(logit_i / T_i) has the lowest
expected calibration error against observed prefix survival, earlier temperatures held fixed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

from dspark.errors import DSparkError
from dspark.fsutil import read_json

CALIBRATION_FILE = "calibration.json"  # written beside a drafter by `dspark calibrate`

# T < 1 sharpens the confidences, T > 1 flattens them.
GRID = torch.tensor(
    [0.1, 0.15, 0.2, 0.25, 0.35, 0.5, 0.65, 0.8, 0.9, 1.0, 1.1, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 4.0, 5.0, 7.0, 10.0]
    + [15.0, 20.0, 30.0, 50.0]
)


@dataclass
class Rounds:
    """logits [N, γ] confidence logits; survived [N, γ] prefix 1..k accepted; verified [N, γ] position k verified."""

    logits: torch.Tensor
    survived: torch.Tensor
    verified: torch.Tensor


def collect_rounds(target, drafter, prompts: list[list[int]], max_new_tokens: int) -> Rounds:
    """Decode the prompts with fixed γ (so every position is observed) and record every round's confidences and
    what survived verification."""
    from dspark.decoding.engine import SpeculativeEngine

    if drafter.confidence_head is None:
        raise DSparkError("the drafter has no confidence head to calibrate")
    logits, accepted, verified = [], [], []

    def record(_request, confidence_logits, ell, acc):
        logits.append(confidence_logits.float())
        accepted.append(acc)
        verified.append(ell)

    SpeculativeEngine(target, drafter).generate(prompts, max_new_tokens, on_round=record)
    k = torch.arange(drafter.block_size)
    return Rounds(torch.stack(logits), torch.tensor(accepted)[:, None] > k, torch.tensor(verified)[:, None] > k)


def survival(logits: torch.Tensor, temperatures: torch.Tensor) -> torch.Tensor:
    return torch.sigmoid(logits / temperatures).cumprod(dim=-1)


ECE_BINS = 10  # equal-width bins of [0, 1], here and in the server's calibration counters


def ece(pred: torch.Tensor, label: torch.Tensor, bins: int = ECE_BINS) -> float:
    """Expected calibration error with equal-width bins."""
    idx = (pred * bins).long().clamp(max=bins - 1)
    count = torch.bincount(idx, minlength=bins).tolist()
    predicted = torch.zeros(bins, dtype=torch.float64).index_add_(0, idx, pred.double()).tolist()
    observed = torch.zeros(bins, dtype=torch.float64).index_add_(0, idx, label.double()).tolist()
    return ece_from_bins(count, predicted, observed)


def ece_from_bins(count: list[float], predicted: list[float], observed: list[float]) -> float:
    """ECE from per-bin totals: how many estimates fell in each bin, their sum, and how many came true."""
    total = sum(count)
    if not total:
        return float("nan")
    return sum(abs(p - o) for n, p, o in zip(count, predicted, observed) if n) / total


def auroc(pred: torch.Tensor, label: torch.Tensor) -> float:
    """Probability that a random positive is scored above a random negative (ties count half)."""
    pos, neg = pred[label.bool()], pred[~label.bool()]
    if len(pos) == 0 or len(neg) == 0:
        return float("nan")
    greater = (pos[:, None] > neg[None, :]).float().mean()
    ties = (pos[:, None] == neg[None, :]).float().mean()
    return float(greater + 0.5 * ties)


def brier(pred: torch.Tensor, label: torch.Tensor) -> float:
    return float(((pred - label.float()) ** 2).mean()) if pred.numel() else float("nan")


ECE_NOISE = 0.005  # ECE differences below this are noise at a few thousand rounds


def fit_sts(rounds: Rounds, grid: torch.Tensor = GRID) -> list[float]:
    """T_k by grid search, k = 1..γ in order, earlier temperatures held. Among temperatures whose ECE is within
    ECE_NOISE of the lowest, the one with the lowest Brier score wins: ECE alone rewards flattening every estimate
    towards the mean, which loses what tells one request's drafts from another's (measured: a flat T = 50 at
    positions 3-7 bought 0.002 of ECE for 0.01 of Brier)."""
    gamma = rounds.logits.shape[1]
    temps = torch.ones(gamma)
    for k in range(gamma):
        sel = rounds.verified[:, k]
        if not sel.any():
            continue
        scores = []
        for t in grid.tolist():
            temps[k] = t
            pred, label = survival(rounds.logits[sel, : k + 1], temps[: k + 1])[:, -1], rounds.survived[sel, k]
            scores.append((ece(pred, label), brier(pred, label), t))
        lowest = min(e for e, _, _ in scores)
        temps[k] = min((b, t) for e, b, t in scores if e <= lowest + ECE_NOISE)[1]
    return [round(t, 4) for t in temps.tolist()]


def fit_platt(logits: torch.Tensor, labels: torch.Tensor, prior: float = 1.0) -> tuple[float, float]:
    """Platt scaling: (a, b) so that σ(a·logit + b) predicts the labels, by maximum likelihood with a Gaussian prior
    of weight `prior` (in examples) around the identity (1, 0), which keeps a small group near its raw estimate."""
    x, y = logits.double(), labels.double()
    params = torch.tensor([1.0, 0.0], dtype=torch.float64, requires_grad=True)
    optimizer = torch.optim.LBFGS([params], max_iter=100, line_search_fn="strong_wolfe")

    def loss():
        optimizer.zero_grad()
        nll = torch.nn.functional.binary_cross_entropy_with_logits(params[0] * x + params[1], y, reduction="sum")
        value = (nll + prior * ((params[0] - 1) ** 2 + params[1] ** 2)) / len(x)
        value.backward()
        return value

    optimizer.step(loss)
    a, b = params.detach().tolist()
    return round(a, 4), round(b, 4)


def report(rounds: Rounds, temperatures: list[float]) -> list[dict]:
    """ECE, AUROC and Brier of prefix survival per position, before (T = 1) and after calibration."""
    gamma = rounds.logits.shape[1]
    before = survival(rounds.logits, torch.ones(gamma))
    after = survival(rounds.logits, torch.tensor(temperatures))
    rows = []
    for k in range(gamma):
        sel = rounds.verified[:, k]
        label = rounds.survived[sel, k]
        rows.append(
            {
                "position": k + 1,
                "rounds": int(sel.sum()),
                "observed_survival": round(float(label.float().mean()), 4) if sel.any() else None,
                "ece_before": round(ece(before[sel, k], label), 4),
                "ece_after": round(ece(after[sel, k], label), 4),
                "auroc": round(auroc(after[sel, k], label), 4),
                "brier_before": round(brier(before[sel, k], label), 4),
                "brier_after": round(brier(after[sel, k], label), 4),
            }
        )
    return rows


def reliability_plot(rounds: Rounds, temperatures: list[float], path, positions=(1, 2, 3), bins: int = 10) -> None:
    from dspark.extras import pyplot

    plt = pyplot()

    gamma = rounds.logits.shape[1]
    fig, axes = plt.subplots(1, len(positions), figsize=(4 * len(positions), 4))
    for ax, k in zip(axes, positions):
        if k > gamma:
            continue
        sel = rounds.verified[:, k - 1]
        label = rounds.survived[sel, k - 1].float()
        for name, temps in (("raw", torch.ones(gamma)), ("STS", torch.tensor(temperatures))):
            pred = survival(rounds.logits[sel], temps)[:, k - 1]
            idx = (pred * bins).long().clamp(max=bins - 1)
            xs, ys = [], []
            for b in range(bins):
                m = idx == b
                if m.sum() >= 5:
                    xs.append(float(pred[m].mean()))
                    ys.append(float(label[m].mean()))
            ax.plot(xs, ys, marker="o", label=f"{name} (ECE {ece(pred, label):.3f})")
        ax.plot([0, 1], [0, 1], color="gray", linestyle="--", linewidth=0.8)
        ax.set(title=f"prefix survival, position {k}", xlabel="predicted", ylabel="observed", xlim=(0, 1), ylim=(0, 1))
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def read_temperatures(file: str | Path) -> list[float]:
    """STS temperatures from a calibration JSON written by `dspark calibrate`."""
    fix = "make one with `dspark calibrate`"
    data = read_json(file, "calibration file", fix)
    temps = data.get("sts_temperatures") if isinstance(data, dict) else None
    if not (
        isinstance(temps, list) and temps and all(type(t) in (int, float) and math.isfinite(t) and t > 0 for t in temps)
    ):
        raise DSparkError(f"calibration file {file} has no sts_temperatures (a list of positive numbers); {fix}")
    return [float(t) for t in temps]


def drafter_temperatures(drafter_path: str | Path) -> list[float] | None:
    """The calibration shipped beside a drafter, if it has one."""
    file = Path(drafter_path) / CALIBRATION_FILE
    return read_temperatures(file) if file.is_file() else None
