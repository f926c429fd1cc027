"""The DSpark training loss (docs/design.md §3): position-weighted cross-entropy, L1 (= 2·TV) against the target's
distribution, and BCE of the confidence head against the soft acceptance label c* = 1 - ½‖p - q‖₁.

The target distribution q comes dense ([N, V], exact) or as its top-K ([N, K] probabilities + target ids). With
top-K, ‖p - q‖₁ is computed as Σ_topK |p - q| + (p mass outside top-K) + (q mass outside top-K): exact when the two
remainders do not overlap, an upper bound otherwise. A reduced draft vocabulary puts p only on the d2t ids; q mass
outside it counts in full, since the drafter can never propose those tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class LossWeights:
    ce: float = 0.1
    tv: float = 0.9
    conf: float = 1.0


@dataclass
class TargetDist:
    probs: torch.Tensor  # [N, V] dense, or [N, K] top-K probabilities
    ids: torch.Tensor | None = None  # [N, K] target token ids of the top-K entries; None when dense


def l1_distance(draft_probs: torch.Tensor, target: TargetDist, d2t: torch.Tensor | None, t2d: torch.Tensor | None):
    """‖p - q‖₁ per row; p [N, Vd] over the draft vocabulary (the full vocabulary when d2t is None)."""
    if target.ids is None:
        q = target.probs if d2t is None else target.probs[:, d2t]
        outside = 0.0 if d2t is None else (1 - q.sum(-1)).clamp_min(0)
        return (draft_probs - q).abs().sum(-1) + outside
    ids = target.ids if t2d is None else t2d[target.ids]
    inside = ids >= 0
    p_at = draft_probs.gather(1, ids.clamp_min(0)) * inside
    q = target.probs
    matched = ((p_at - q).abs() * inside).sum(-1) + (q * ~inside).sum(-1)
    p_rest = (1 - p_at.sum(-1)).clamp_min(0)
    q_rest = (1 - q.sum(-1)).clamp_min(0)
    return matched + p_rest + q_rest


def dspark_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    confidence_logits: torch.Tensor | None,
    weights: torch.Tensor,
    target: TargetDist | None,
    alphas: LossWeights,
    d2t: torch.Tensor | None = None,
    t2d: torch.Tensor | None = None,
    denominator: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict]:
    """All inputs flattened over supervised positions: logits [N, Vd], labels [N] target ids, confidence [N],
    weights [N] (position decay × mask). `denominator` (Σ weights over all ranks) makes the result a global mean.

    Returns (loss, metrics) where metrics hold each term's weighted mean and the mean acceptance 1 - TV."""
    denom = weights.sum() if denominator is None else denominator
    denom = denom.clamp_min(1e-6)
    log_p = F.log_softmax(logits.float(), dim=-1)
    draft_labels = labels if t2d is None else t2d[labels]
    in_vocab = draft_labels >= 0
    ce = -log_p.gather(1, draft_labels.clamp_min(0)[:, None]).squeeze(1) * in_vocab
    terms = {"ce": (ce * weights).sum() / denom}
    loss = alphas.ce * terms["ce"]
    accept = None
    if target is not None and (alphas.tv > 0 or (alphas.conf > 0 and confidence_logits is not None)):
        l1 = l1_distance(log_p.exp(), target, d2t, t2d)
        accept = (1 - 0.5 * l1).clamp(0, 1)
        terms["tv"] = (l1 * weights).sum() / denom
        loss = loss + alphas.tv * terms["tv"]
        if confidence_logits is not None and alphas.conf > 0:
            bce = F.binary_cross_entropy_with_logits(confidence_logits.float(), accept.detach(), reduction="none")
            terms["conf"] = (bce * weights).sum() / denom
            loss = loss + alphas.conf * terms["conf"]
    metrics = {k: float(v.detach()) for k, v in terms.items()}
    metrics["loss"] = float(loss.detach())
    if accept is not None:
        metrics["accept"] = float((accept.detach() * (weights > 0)).sum() / (weights > 0).sum().clamp_min(1))
    return loss, metrics
