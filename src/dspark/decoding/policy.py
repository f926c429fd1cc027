"""Verification-length policies: how many of the γ draft tokens each request sends to the target this round.

A policy sees the round's proposal (its confidences) and returns ℓ_r ∈ [0, γ] per request. The decision for
position k may depend only on what was drafted before k (a stopping rule), or verification stops being lossless.
"""

from __future__ import annotations

import torch

from dspark.errors import DSparkError


class FixedLength:
    """Verify a fixed number of draft tokens (γ by default): plain chain drafting."""

    def __init__(self, length: int | None = None):
        if length is not None and length < 0:
            raise DSparkError(f"verification length must be >= 0, got {length}")
        self.length = length

    def lengths(self, confidence: torch.Tensor | None, gamma: int, batch: int) -> torch.Tensor:
        length = gamma if self.length is None else min(self.length, gamma)
        return torch.full((batch,), length, dtype=torch.long)

    def describe(self) -> str:
        return f"fixed({'γ' if self.length is None else self.length})"


class ConfidenceThreshold:
    """Static threshold (paper Fig. 5): stop before the first position whose confidence c_k is below `threshold`."""

    def __init__(self, threshold: float):
        if not 0 <= threshold <= 1:
            raise DSparkError(f"confidence threshold must be in [0, 1], got {threshold}")
        self.threshold = threshold

    def lengths(self, confidence: torch.Tensor | None, gamma: int, batch: int) -> torch.Tensor:
        if confidence is None:
            raise DSparkError("the threshold policy needs a drafter with a confidence head")
        keep = (confidence >= self.threshold).long().cumprod(dim=1)
        return keep.sum(dim=1)

    def describe(self) -> str:
        return f"threshold({self.threshold})"
