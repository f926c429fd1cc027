"""The learning-rate schedule (warmup, then cosine) and its length under --max-minutes."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from dspark.training.config import TrainConfig

FIT_AFTER_STEPS = 10  # steps timed before --max-minutes first sets the schedule's length; it is set again after 20,


def fit_to_minutes(total: int, step: int, seconds_per_step: float, seconds_left: float, device: torch.device) -> int:
    """The schedule's length once the step time is known: as many more steps as fit the time left, never beyond
    `total` nor before this step; every rank gets the smallest, so all stop together."""
    fitted = torch.tensor(
        [min(total, step + max(0, int(seconds_left / seconds_per_step)))], device=device
    )  # NCCL: on the GPU
    if dist.is_initialized():
        dist.all_reduce(fitted, op=dist.ReduceOp.MIN)
    return int(fitted.item())


def lr_at(step: int, total: int, cfg: TrainConfig) -> float:
    warmup = max(1, int(cfg.warmup_ratio * total))
    if step < warmup:
        return cfg.lr * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return cfg.lr * 0.5 * (1 + math.cos(math.pi * progress))
