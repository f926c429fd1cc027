"""Anchors and block supervision (docs/design.md §3): which γ-blocks a training sequence contributes, and which of their
positions carry loss."""

from __future__ import annotations

import torch


def anchor_candidates(loss_mask: torch.Tensor) -> torch.Tensor:
    """[B, L] bool: positions p where the anchor p and its next token p+1 are both inside the loss mask."""
    mask = loss_mask.bool()
    out = torch.zeros_like(mask)
    out[:, :-1] = mask[:, :-1] & mask[:, 1:]
    return out


def sample_anchors(loss_mask: torch.Tensor, num_anchors: int, generator: torch.Generator | None = None):
    """Up to `num_anchors` distinct candidate positions per row, in increasing order.

    Returns anchors [B, A] and valid [B, A] (rows with fewer candidates are padded with position 0, not valid);
    A = min(num_anchors, most candidates in any row)."""
    candidates = anchor_candidates(loss_mask)
    keys = torch.rand(candidates.shape, generator=generator)
    keys[~candidates] = 2.0  # candidates sort first, in random order
    count = int(candidates.sum(dim=1).max().clamp(max=num_anchors))
    chosen = keys.argsort(dim=1)[:, :count]
    valid = torch.gather(candidates, 1, chosen)
    anchors = torch.where(valid, chosen, 0)
    order = torch.where(valid, anchors, anchors.new_full((), loss_mask.shape[1])).argsort(dim=1)
    return anchors.gather(1, order), valid.gather(1, order)


def block_supervision(loss_mask: torch.Tensor, anchors: torch.Tensor, valid: torch.Tensor, block_size: int):
    """[B, A, γ] bool: block position k (label at anchor + k) is supervised while the labels form a contiguous
    in-mask prefix inside the sequence."""
    length = loss_mask.shape[1]
    label_pos = anchors[..., None] + torch.arange(1, block_size + 1)
    inside = label_pos < length
    in_mask = torch.gather(loss_mask.bool(), 1, label_pos.clamp(max=length - 1).flatten(1)).view_as(label_pos)
    return ((inside & in_mask & valid[..., None]).long().cumprod(dim=-1)).bool()


def position_weights(block_size: int, decay: float) -> torch.Tensor:
    """w_k = exp(-(k-1)/λ), k = 1..γ; λ <= 0 turns the decay off."""
    k = torch.arange(block_size, dtype=torch.float32)
    return torch.exp(-k / decay) if decay > 0 else torch.ones(block_size)
