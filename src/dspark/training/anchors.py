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


def sample_anchors(
    loss_mask: torch.Tensor,
    num_anchors: int,
    generator: torch.Generator | None = None,
    preferred: torch.Tensor | None = None,
    preferred_share: float = 0.0,
):
    """Up to `num_anchors` distinct candidate positions per row, in increasing order; with `preferred` ([B, L] bool),
    up to round(preferred_share · num_anchors) of them are drawn from the preferred candidates first.

    Returns anchors [B, A] and valid [B, A] (rows with fewer candidates are padded with position 0, not valid);
    A = min(num_anchors, most candidates in any row)."""
    candidates = anchor_candidates(loss_mask)
    keys = torch.rand(candidates.shape, generator=generator)
    if preferred is not None and preferred_share > 0:
        quota = round(preferred_share * num_anchors)
        ranked = torch.where(preferred & candidates, keys, 2.0).argsort(dim=1).argsort(dim=1)
        keys = torch.where(preferred & candidates & (ranked < quota), keys - 1, keys)  # the quota sorts first
    keys[~candidates] = 2.0  # candidates sort first, in random order
    count = int(candidates.sum(dim=1).max().clamp(max=num_anchors))
    chosen = keys.argsort(dim=1)[:, :count]
    valid = torch.gather(candidates, 1, chosen)
    anchors = torch.where(valid, chosen, 0)
    order = torch.where(valid, anchors, anchors.new_full((), loss_mask.shape[1])).argsort(dim=1)
    return anchors.gather(1, order), valid.gather(1, order)


def decoding_rounds(first: int, length: int, gamma: int, run_at) -> list[tuple[int, int, int]]:
    """The rounds greedy decoding at a fixed γ takes through an answer of `length` tokens starting at position `first`,
    given `run_at(anchor)`, the leading run of drafts equal to the text after an anchor: (anchor, verified, accepted)
    per round. The first token comes from the prefill; each round's anchor is one past the last accepted draft; no
    round verifies past the answer's end (the engine's rule at max_new_tokens = length)."""
    rounds, produced = [], 1
    while produced < length:
        anchor, verified = first + produced - 1, min(gamma, length - produced - 1)
        accepted = min(run_at(anchor), verified)
        rounds.append((anchor, verified, accepted))
        produced += accepted + 1
    return rounds


def answer_spans(loss_mask: torch.Tensor) -> list[tuple[int, int]]:
    """(first position, length) of each run of ones in a [L] mask: the answers of a (possibly multi-turn) record."""
    mask = loss_mask.bool().tolist()
    spans, start = [], None
    for p, inside in enumerate(mask + [False]):
        if inside and start is None:
            start = p
        elif not inside and start is not None:
            spans.append((start, p - start))
            start = None
    return spans


@torch.no_grad()
def leading_runs(
    drafter, features: torch.Tensor, input_ids: torch.Tensor, loss_mask: torch.Tensor, chunk: int = 128
) -> torch.Tensor:
    """[B, L]: at every anchor candidate, how many greedy drafts in a row equal the answer text after it (-1 at other
    positions), from the drafter's training forward in chunks of `chunk` anchors per row."""
    mask = loss_mask.bool()
    candidates = anchor_candidates(mask.cpu()).to(mask.device)
    runs = torch.full(mask.shape, -1, dtype=torch.long, device=mask.device)
    offsets = torch.arange(1, drafter.block_size + 1, device=mask.device)
    for row in range(mask.shape[0]):
        positions = candidates[row].nonzero()[:, 0]
        for part in positions.split(chunk):
            out = drafter(features[row : row + 1], input_ids[row : row + 1], part[None])
            guess = out.logits[0].argmax(-1)
            guess = guess if drafter.d2t is None else drafter.d2t[guess]
            label_pos = part[:, None] + offsets
            inside = (label_pos < mask.shape[1]) & mask[row][label_pos.clamp(max=mask.shape[1] - 1)]
            runs[row, part] = ((guess == out.labels[0]) & inside).long().cumprod(-1).sum(-1)
    return runs


def rounds_by_row(runs: torch.Tensor, loss_mask: torch.Tensor, gamma: int) -> list[list[tuple[int, int, int]]]:
    """Per row, the rounds (`decoding_rounds`) greedy decoding takes through each of its answers, given
    `leading_runs`."""
    walks = []
    for row_runs, mask in zip(runs.cpu(), loss_mask.cpu()):
        walks.append(
            [
                r
                for first, length in answer_spans(mask)
                for r in decoding_rounds(first, length, gamma, lambda p: int(row_runs[p]))
            ]
        )
    return walks


def visited_anchors(runs: torch.Tensor, loss_mask: torch.Tensor, gamma: int) -> torch.Tensor:
    """[B, L] bool: the anchors greedy decoding visits in each answer of each row, given `leading_runs`."""
    visited = torch.zeros(runs.shape, dtype=torch.bool)
    for row, walk in enumerate(rounds_by_row(runs, loss_mask, gamma)):
        for anchor, _, _ in walk:
            visited[row, anchor] = True
    return visited


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
