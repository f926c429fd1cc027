"""What the speculative loop needs from a drafter, and nothing more: the one interface every proposer implements.

The engine (decoding/) drives any object of this shape; the drafters (drafter/) implement it without knowing the
loop. A proposer keeps its own per-request context in a cache it creates, which the engine keeps in step with the
batch (rows leave with `select`, batches join with `merge`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from dspark.sampling import Sampling


@dataclass
class Proposal:
    tokens: torch.Tensor  # [B, γ] draft tokens, target ids
    probs: torch.Tensor | None  # [B, γ, V] the exact distributions they were sampled from (None when greedy)
    confidence_logits: torch.Tensor | None  # [B, γ] logit of c_k (None without a confidence head)
    lengths: torch.Tensor | None = None  # [B] drafts each row has, at most γ (None: all γ); the rest is padding


class ProposerCache(Protocol):
    def select(self, rows: torch.Tensor) -> None:
        """Keep only these rows, in this order."""

    def merge(self, other) -> None:
        """Append the rows of another cache of the same proposer."""


class Proposer(Protocol):
    block_size: int  # γ: draft tokens per round
    target_layer_ids: list[int]  # target layers whose outputs the proposer reads as context features

    def new_cache(self, batch_size: int) -> ProposerCache: ...

    def eval(self) -> Proposer:
        """Inference mode (nn.Module's eval; proposers without weights return themselves)."""

    def extend_context(self, cache, features: torch.Tensor, num_new: torch.Tensor, next_ids: torch.Tensor) -> None:
        """Append the target features of newly accepted tokens ([B, n, F], the first num_new[b] real); next_ids
        [B, n] is the token after each new position."""

    def propose(
        self, cache, anchor_ids: torch.Tensor, sampling: Sampling, generators: list[torch.Generator] | None = None
    ) -> Proposal: ...
