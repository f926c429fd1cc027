"""Logit processing and sampling, shared by plain decoding, the drafter and verification.

Losslessness needs the drafter to sample from exactly the distribution it reports, with the same processing that is
applied to the target's logits; both sides call `logits_to_probs` with the same SamplingParams.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dspark.errors import DSparkError


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    seed: int | None = None

    def __post_init__(self):
        if self.temperature < 0:
            raise DSparkError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if self.top_k < 0:
            raise DSparkError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise DSparkError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def generators(self, count: int, device="cpu") -> list[torch.Generator]:
        """One generator per request, so a request's randomness does not depend on its batch neighbours."""
        gens = []
        for i in range(count):
            g = torch.Generator(device=device)
            if self.seed is None:
                g.seed()
            else:
                g.manual_seed(self.seed + i)
            gens.append(g)
        return gens


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, then top-k, then top-p; float32 probabilities over the last dimension."""
    logits = logits.float() / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        # Drop a token when the tokens before it already reach top_p; the first token always stays.
        drop_sorted = (sorted_probs.cumsum(-1) - sorted_probs) >= params.top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample_rows(probs: torch.Tensor, generators: list[torch.Generator]) -> torch.Tensor:
    """One token per row of probs [B, V], each row with its own generator."""
    return torch.cat([torch.multinomial(probs[i], 1, generator=g) for i, g in enumerate(generators)])


def next_token(logits: torch.Tensor, params: SamplingParams, generators: list[torch.Generator]) -> torch.Tensor:
    """Greedy argmax or a sample from the processed distribution, for logits [B, V]."""
    if params.greedy:
        return logits.argmax(dim=-1)
    return sample_rows(logits_to_probs(logits, params), generators)
