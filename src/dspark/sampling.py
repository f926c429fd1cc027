"""Logit processing and sampling, shared by plain decoding, the drafter and verification.

Losslessness needs the drafter to sample from exactly the distribution it reports, with the same processing that is
applied to the target's logits; both sides call `logits_to_probs` with the same SamplingParams.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dspark.errors import DSparkError

MAX_SEED = (1 << 63) - 1  # request i of a batch seeds its generator with seed + i; torch takes up to 2**64 - 1


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
        if self.seed is not None and not 0 <= self.seed <= MAX_SEED:
            raise DSparkError(f"seed must be between 0 and {MAX_SEED}, got {self.seed}")

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


# One SamplingParams for a whole batch, or one per row (requests of a server batch each bring their own).
Sampling = SamplingParams | list[SamplingParams]


def all_greedy(sampling: Sampling) -> bool:
    return sampling.greedy if isinstance(sampling, SamplingParams) else all(p.greedy for p in sampling)


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, then top-k, then top-p; float32 probabilities over the last dimension. Greedy (temperature 0)
    is the one-hot distribution of the argmax, so a greedy row can share a sampled batch's rejection sampling: it
    then accepts exactly the drafts that equal the target's argmax and adds the argmax."""
    if params.greedy:
        return torch.zeros_like(logits, dtype=torch.float32).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
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


def rows_to_probs(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """logits_to_probs over logits [B, ..., V] with each row's own parameters (rows that share them together)."""
    if isinstance(sampling, SamplingParams):
        return logits_to_probs(logits, sampling)
    out = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
    groups: dict[SamplingParams, list[int]] = {}
    for row, params in enumerate(sampling):
        groups.setdefault(params, []).append(row)
    for params, rows in groups.items():
        index = torch.tensor(rows, device=logits.device)
        out[index] = logits_to_probs(logits[index], params)
    return out


def sample_rows(probs: torch.Tensor, generators: list[torch.Generator]) -> torch.Tensor:
    """One token per row of probs [B, V], each row with its own generator."""
    return torch.cat([torch.multinomial(probs[i], 1, generator=g) for i, g in enumerate(generators)])


def next_token(logits: torch.Tensor, sampling: Sampling, generators: list[torch.Generator]) -> torch.Tensor:
    """Greedy argmax or a sample from the processed distribution, for logits [B, V]."""
    if all_greedy(sampling):
        return logits.argmax(dim=-1)
    return sample_rows(rows_to_probs(logits, sampling), generators)
