"""Verification-length policies: how many of the γ draft tokens each request sends to the target this round.

Every policy implements `VerifyPolicy`: fixed length and the static confidence threshold here, the cost-aware
schedulers (Algorithm 1 and the production variant) in scheduling/planner.py.

A policy first says whether a round drafts at all (a round that does not verifies each anchor alone, as plain
decoding does, and saves the drafter's share of the round); a drafted round's policy sees its confidence logits
([B, γ], None for drafters without a confidence head) and returns ℓ_r ∈ [0, γ] per request. The decision for
position k may depend only on what was drafted before k (a stopping rule), or verification stops being lossless;
whether to draft is decided before anything is drafted, so it is lossless whatever it reads.
"""

from __future__ import annotations

from typing import Protocol

import torch

from dspark.errors import DSparkError


class VerifyPolicy(Protocol):
    def drafts(self, rows: int) -> bool:
        """Whether a round of `rows` rows drafts at all."""

    def restart(self) -> None:
        """Requests join an engine that had none: what the policy learnt from earlier rounds may be dropped."""

    def lengths(self, confidence_logits: torch.Tensor | None, gamma: int, batch: int) -> torch.Tensor:
        """ℓ_r ∈ [0, γ] per request [batch] for this round, from the drafts' confidence logits [batch, γ]."""

    def describe(self) -> str:
        """A few words for logs and reports."""

    def survival(self, confidence_logits: torch.Tensor | None) -> torch.Tensor | None:
        """The policy's estimate that drafts 1..k all survive, [batch, γ] (None without a confidence head)."""

    planned_ms: float | None
    """What the policy's cost table priced the round it last planned, in milliseconds (None: it has no table)."""


def confidences(logits: torch.Tensor | None, policy: str, temperatures=None) -> torch.Tensor:
    """c_k = σ(logit_k / T_k) (T = 1 unless calibrated)."""
    if logits is None:
        raise DSparkError(f"the {policy} policy needs a drafter with a confidence head")
    if temperatures is not None:
        logits = logits / torch.as_tensor(temperatures, dtype=logits.dtype)[: logits.shape[1]]
    return torch.sigmoid(logits)


def prefix_survival(logits: torch.Tensor | None, policy: str, temperatures=None) -> torch.Tensor:
    """a_k = Π_{i≤k} c_i [B, γ]: the estimate that drafts 1..k all survive verification."""
    return confidences(logits, policy, temperatures).float().cumprod(dim=1)


class BasePolicy:
    """What policies share unless they say otherwise: every round drafts, and survival comes from the confidence
    head, scaled by the policy's STS temperatures where it has them."""

    temperatures: list[float] | None = None
    planned_ms: float | None = None

    def drafts(self, rows: int) -> bool:
        return True

    def restart(self) -> None:
        """Requests join an idle engine: forget what earlier requests taught (nothing here)."""

    def survival(self, confidence_logits: torch.Tensor | None) -> torch.Tensor | None:
        if confidence_logits is None:
            return None
        return prefix_survival(confidence_logits, "survival", self.temperatures)


class FixedLength(BasePolicy):
    """Verify a fixed number of draft tokens (γ by default): plain chain drafting."""

    def __init__(self, length: int | None = None):
        if length is not None and length < 0:
            raise DSparkError(f"verification length must be >= 0, got {length}")
        self.length = length

    def drafts(self, rows: int) -> bool:
        return self.length != 0

    def lengths(self, confidence_logits: torch.Tensor | None, gamma: int, batch: int) -> torch.Tensor:
        length = gamma if self.length is None else min(self.length, gamma)
        return torch.full((batch,), length, dtype=torch.long)

    def describe(self) -> str:
        return f"fixed({'γ' if self.length is None else self.length})"


class ConfidenceThreshold(BasePolicy):
    """Static threshold (paper Fig. 5): stop before the first position whose confidence c_k is below `threshold`."""

    def __init__(self, threshold: float):
        if not 0 <= threshold <= 1:
            raise DSparkError(f"confidence threshold must be in [0, 1], got {threshold}")
        self.threshold = threshold

    def lengths(self, confidence_logits: torch.Tensor | None, gamma: int, batch: int) -> torch.Tensor:
        keep = (confidences(confidence_logits, "threshold") >= self.threshold).long().cumprod(dim=1)
        return keep.sum(dim=1)

    def describe(self) -> str:
        return f"threshold({self.threshold})"
