"""The DSpark drafter and suffix decoding together: per round and per row, the draft worth verifying.

The two see different things: the drafter predicts new text from the target's features, the suffix trees predict
what repeats (a loop, a quoted prompt, a rewrite of an earlier answer). Each round the trees draft first, at no model
cost; a row whose tree draft comes from a context match of at least MIN_MATCH tokens and is expected to accept at
least `min_expected` tokens (Σ_k Π_{i≤k} p_i from the trees' count-based probabilities) verifies it, the others the drafter's, and where every row takes the tree the drafter's
forward is skipped (its context still grows with every accepted token, so it catches up as after a plain round).

The choice depends on the context alone, never on what the drafter sampled: selecting a sampled draft by its own
tokens would bias the proposal and break rejection sampling's losslessness. The schedulers see each row's chosen
draft with its survival estimate: the confidence head's for the drafter, the tree's probability for the tree
(expressed in the head's logit space, so that the policy's STS temperatures give back the tree's probability).
"""

from __future__ import annotations

from collections import Counter

import torch

from dspark.drafter.suffix import SuffixProposer, expected_accepted
from dspark.proposer import Proposal
from dspark.sampling import Sampling

# A tree draft is taken where it comes from a context match of MIN_MATCH tokens and is expected to accept MIN_EXPECTED
# tokens: the best rule of those replayed on the drafter's and the tree's drafts of real rounds (docs/experiments.md).
MIN_EXPECTED = 0.5
MIN_MATCH = 2


class HybridCache:
    def __init__(self, drafter_cache, tree_cache):
        self.drafter, self.tree = drafter_cache, tree_cache

    def select(self, rows: torch.Tensor) -> None:
        self.drafter.select(rows)
        self.tree.select(rows)

    def merge(self, other: HybridCache) -> None:
        self.drafter.merge(other.drafter)
        self.tree.merge(other.tree)


class HybridProposer:
    def __init__(self, drafter, tree: SuffixProposer, min_expected: float = MIN_EXPECTED):
        if tree.block_size != drafter.block_size:
            raise ValueError("the suffix proposer drafts as many tokens as the drafter")
        self.drafter, self.tree, self.min_expected = drafter, tree, min_expected
        self.block_size, self.target_layer_ids = drafter.block_size, list(drafter.target_layer_ids)
        self.confidence_head = getattr(drafter, "confidence_head", False)
        self.temperatures: list[float] | None = None  # the policy's STS temperatures, set by whoever builds it
        self.rows_by_source: Counter = Counter()  # drafted rows per source, for reports

    def eval(self) -> HybridProposer:
        self.drafter.eval()
        return self

    def new_cache(self, batch_size: int) -> HybridCache:
        return HybridCache(self.drafter.new_cache(batch_size), self.tree.new_cache(batch_size))

    def extend_context(self, cache: HybridCache, features, num_new: torch.Tensor, next_ids: torch.Tensor) -> None:
        self.drafter.extend_context(cache.drafter, features, num_new, next_ids)
        self.tree.extend_context(cache.tree, features, num_new, next_ids)

    def propose(self, cache: HybridCache, anchor_ids: torch.Tensor, sampling: Sampling, generators=None) -> Proposal:
        tree = self.tree.propose(cache.tree, anchor_ids, sampling, generators)
        take_tree = expected_accepted(tree.confidence_logits) >= self.min_expected
        tree_logits = tree.confidence_logits
        if self.temperatures is not None:  # the policy divides by T_k: the tree's probability comes back
            tree_logits = tree_logits * torch.as_tensor(self.temperatures, dtype=tree_logits.dtype)[: self.block_size]
        self.rows_by_source["suffix"] += int(take_tree.sum())
        if bool(take_tree.all()):
            return Proposal(tree.tokens, tree.probs, tree_logits, tree.lengths)
        self.rows_by_source["drafter"] += int((~take_tree).sum())
        own = self.drafter.propose(cache.drafter, anchor_ids, sampling, generators)
        pick = take_tree.to(own.tokens.device)
        tokens = torch.where(pick[:, None], tree.tokens, own.tokens)
        full = torch.full_like(tree.lengths, self.block_size)
        lengths = torch.where(pick, tree.lengths, own.lengths if own.lengths is not None else full)
        logits = None
        if own.confidence_logits is not None:
            logits = torch.where(pick[:, None], tree_logits.to(own.confidence_logits), own.confidence_logits)
        probs = None
        if own.probs is not None:
            probs = torch.where(pick[:, None, None], tree.probs.to(own.probs), own.probs)
        return Proposal(tokens, probs, logits, lengths)


def attune(proposer, policy):
    """The proposer, told the policy's STS temperatures where it states survival in their terms (the hybrid)."""
    if isinstance(proposer, HybridProposer):
        proposer.temperatures = getattr(policy, "temperatures", None)
    return proposer
