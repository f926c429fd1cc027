"""Verification (docs/design.md §4): which draft tokens the target keeps, and the token it adds after them.

Both rules return, per row, the number of accepted draft tokens a ∈ [0, ℓ] and the next token: the target's own
token at the first mismatch/rejection, or the bonus token after ℓ accepted drafts. τ = a + 1.
"""

from __future__ import annotations

import torch

from dspark.sampling import Sampling, rows_to_probs


def verify_greedy(target_logits: torch.Tensor, draft_tokens: torch.Tensor, lengths: torch.Tensor):
    """target_logits [B, W, V] over [x0, x1..x_{W-1}]; draft_tokens [B, >=W-1]; lengths ℓ [B] <= W-1."""
    choice = target_logits.argmax(dim=-1)
    width = choice.shape[1] - 1
    match = draft_tokens[:, :width] == choice[:, :width]
    match &= torch.arange(width, device=match.device)[None, :] < lengths[:, None]
    accepted = match.long().cumprod(dim=1).sum(dim=1)
    return accepted, choice.gather(1, accepted[:, None]).squeeze(1)


def residual_distribution(q: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """normalize(max(0, q - p)): what the target still owes after a rejected draft."""
    dist = (q - p).clamp_min(0)
    total = dist.sum()
    return dist / total if total > 0 else q  # p == q up to rounding: the rejection was rounding noise


def verify_sampling(
    target_logits: torch.Tensor,
    draft_probs: torch.Tensor,
    draft_tokens: torch.Tensor,
    lengths: torch.Tensor,
    sampling: Sampling,
    generators: list[torch.Generator],
):
    """Rejection sampling: accept x_k with probability min(1, q(x_k)/p(x_k)); at the first rejection sample from
    normalize(max(0, q - p)); when all ℓ are accepted, sample the bonus from q. p and q carry the same processing."""
    q = rows_to_probs(target_logits, sampling)
    accepted, next_tokens = [], []
    for b, gen in enumerate(generators):
        ell = int(lengths[b])
        a = 0
        while a < ell:
            x = draft_tokens[b, a]
            u = torch.rand((), generator=gen)
            if u * draft_probs[b, a, x] < q[b, a, x]:
                a += 1
                continue
            break
        dist = residual_distribution(q[b, a], draft_probs[b, a]) if a < ell else q[b, a]
        accepted.append(a)
        next_tokens.append(torch.multinomial(dist, 1, generator=gen))
    return torch.tensor(accepted, device=q.device), torch.cat(next_tokens)
