"""What the run measures as it goes: teacher-forced τ on held-out records, and real decoding on evaluation prompts."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch

from dspark.records import Example
from dspark.training.anchors import (
    leading_runs,
    rounds_by_row,
)
from dspark.training.batches import plan_blocks
from dspark.training.config import TrainConfig

# Blocks per held-out sequence: fixed, so runs trained with different --num-anchors are measured alike.
EVAL_ANCHORS = 256


@torch.no_grad()
def evaluate(drafter, source, examples: list[Example], cfg: TrainConfig, batch_size: int) -> dict:
    """Teacher-forced acceptance on held-out data. With greedy regenerated data, a block's greedy τ is 1 + its
    leading run of draft argmax == label, exactly what the engine would accept at that anchor: at sampled anchors
    (tau_greedy), and along the rounds greedy decoding of the held-out prompts takes (tau_rounds)."""
    drafter.eval()
    gamma = cfg.block_size
    cfg = replace(cfg, num_anchors=EVAL_ANCHORS, rollout_anchors=0.0)
    runs, blocks, accepted_pos, reached_pos = 0.0, 0, torch.zeros(gamma), torch.zeros(gamma)
    rounds, round_tokens = 0, 0
    by_source: dict[str, list[float]] = {}  # source -> [accepted drafts, blocks]
    g = torch.Generator().manual_seed(1234)
    for s in range(0, len(examples), batch_size):
        chunk = examples[s : s + batch_size]
        batch = source(chunk)
        plan = plan_blocks(batch, cfg, g)
        full = plan.supervised.all(-1)
        with torch.autocast(batch.input_ids.device.type, dtype=torch.bfloat16, enabled=cfg.bf16):
            out = drafter(batch.features, batch.input_ids, plan.anchors)
        guess = out.logits.argmax(-1)
        guess = guess if drafter.d2t is None else drafter.d2t[guess]
        match = (guess == out.labels)[full]
        lead = match.long().cumprod(-1)
        runs += float(lead.sum())
        blocks += match.shape[0]
        for row, accepted in zip(full.nonzero()[:, 0].tolist(), lead.sum(-1).tolist()):
            tally = by_source.setdefault(chunk[row].source or "other", [0.0, 0])
            tally[0] += accepted
            tally[1] += 1
        reached = torch.cat([torch.ones_like(lead[:, :1]), lead[:, :-1]], dim=1)
        accepted_pos += lead.sum(0).float().cpu()
        reached_pos += reached.sum(0).float().cpu()
        with torch.autocast(batch.input_ids.device.type, dtype=torch.bfloat16, enabled=cfg.bf16):
            every = leading_runs(drafter, batch.features, batch.input_ids, batch.loss_mask)
        for walk in rounds_by_row(every, batch.loss_mask, gamma):
            rounds += len(walk)
            round_tokens += sum(accepted + 1 for _, _, accepted in walk)
    drafter.train()
    if not blocks:
        return {}
    return {
        "tau_greedy": round(1 + runs / blocks, 4),
        "eval_blocks": blocks,
        "tau_rounds": round(round_tokens / rounds, 4) if rounds else None,
        "tau_by_source": {k: round(1 + a / n, 4) for k, (a, n) in sorted(by_source.items())},
        "accept_by_position": [round(float(a / r), 4) if r else None for a, r in zip(accepted_pos, reached_pos)],
    }


def decode_eval_prompts(target, cfg: TrainConfig) -> dict[str, list[list[int]]]:
    """The fixed slice the real-decoding evaluation decodes: the first prompts of each evaluation set, as token ids."""
    from dspark.assets import eval_prompts

    if cfg.decode_eval_every <= 0:
        return {}
    return {
        Path(name).stem: [target.encode_chat(p) for p in eval_prompts(name, cfg.decode_eval_prompts)]
        for name in cfg.decode_eval_sets
    }


def decode_eval(drafter, target, prompts: dict[str, list[list[int]]], max_new_tokens: int) -> dict:
    """τ of real greedy speculative decoding at a fixed γ on each set: what users get, not the teacher-forced proxy
    (the drafter reads the features of its own accepted tokens, and drafts past the first miss are wasted)."""
    from dspark.decoding.engine import SpeculativeEngine
    from dspark.decoding.policy import FixedLength
    from dspark.decoding.stats import SpecStats

    engine = SpeculativeEngine(target, drafter, FixedLength())
    taus, merged = {}, SpecStats(drafter.block_size)
    with torch.no_grad():
        for name, ids in prompts.items():
            stats = SpecStats(drafter.block_size)
            for result in engine.generate(ids, max_new_tokens):
                stats = stats.merge(result.stats)
            taus[name] = round(stats.tau, 3)
            merged = merged.merge(stats)
    drafter.train()
    return {
        "decode_tau": taus,
        "decode_tau_all": round(merged.tau, 3),
        "decode_accept_1": round(merged.accept_by_position()[0] or 0.0, 4),
    }
