"""Verification (docs/design.md §4): which draft tokens the target keeps, and the token it adds after them.

Both rules return, per row, the number of accepted draft tokens a ∈ [0, ℓ] and the next token: the target's own
token at the first mismatch/rejection, or the bonus token after ℓ accepted drafts. τ = a + 1.
"""

from __future__ import annotations

import torch

from dspark.sampling import Sampling, rows_to_probs, sample_rows


def verify_greedy(target_logits: torch.Tensor, draft_tokens: torch.Tensor, lengths: torch.Tensor):
    """target_logits [B, W, V] over [x0, x1..x_{W-1}]; draft_tokens [B, >=W-1]; lengths ℓ [B] <= W-1."""
    choice = target_logits.argmax(dim=-1)
    width = choice.shape[1] - 1
    match = draft_tokens[:, :width] == choice[:, :width]
    match &= torch.arange(width, device=match.device)[None, :] < lengths[:, None]
    accepted = match.long().cumprod(dim=1).sum(dim=1)
    return accepted, choice.gather(1, accepted[:, None]).squeeze(1)


def residual_distribution(q: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """normalize(max(0, q - p)) per row of [B, V]: what the target still owes after a rejected draft."""
    dist = (q - p).clamp_min(0)
    total = dist.sum(dim=-1, keepdim=True)
    # p == q up to rounding: the rejection was rounding noise, and q is what is owed
    return torch.where(total > 0, dist / total.clamp_min(torch.finfo(dist.dtype).tiny), q)


def verify_sampling(
    target_logits: torch.Tensor,
    draft_probs: torch.Tensor | None,
    draft_tokens: torch.Tensor,
    lengths: torch.Tensor,
    sampling: Sampling,
    generators: list[torch.Generator],
):
    """Rejection sampling: accept x_k with probability min(1, q(x_k)/p(x_k)); at the first rejection sample from
    normalize(max(0, q - p)); when all ℓ are accepted, sample the bonus from q. p and q carry the same processing.
    Every row draws ℓ uniforms and then one token from its own generator, so its randomness does not depend on the
    rows beside it."""
    q = rows_to_probs(target_logits, sampling)
    rows, width = q.shape[0], q.shape[1] - 1
    accepted = torch.zeros(rows, dtype=torch.long, device=q.device)
    dist = q[:, 0]
    if width and draft_probs is not None:
        ells = lengths.tolist()
        u = torch.ones(rows, width)  # past a row's ℓ: never accepted
        for b, gen in enumerate(generators):
            u[b, : ells[b]] = torch.rand(ells[b], generator=gen)
        drafts = draft_tokens[:, :width, None]
        p_x = draft_probs[:, :width].gather(-1, drafts).squeeze(-1)
        q_x = q[:, :width].gather(-1, drafts).squeeze(-1)
        keep = (u.to(q.device) * p_x < q_x) & (torch.arange(width, device=q.device) < lengths[:, None])
        accepted = keep.long().cumprod(dim=1).sum(dim=1)
        at = accepted[:, None, None].expand(-1, 1, q.shape[-1])
        q_next = q.gather(1, at).squeeze(1)
        p_next = draft_probs.gather(1, at.clamp(max=width - 1)).squeeze(1)
        rejected = (accepted < lengths)[:, None]
        dist = torch.where(rejected, residual_distribution(q_next, p_next), q_next)
    return accepted, sample_rows(dist, generators)
