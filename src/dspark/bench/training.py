"""`dspark bench train`: what a training step costs under each efficiency lever, on the same real batches.

Each setting is a set of TrainConfig overrides; every setting trains the same batches for a few steps after a
warm-up. The result is the time per step split into the target's features (forward, or cache read) and the rest
(q at supervised positions, drafter forward and backward, optimizer), and the time per supervised block position.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from dspark.bench.report import section_header
from dspark.training.batches import block_loss, load_examples, plan_blocks
from dspark.training.config import TrainConfig
from dspark.training.features import CachedFeatures, OnlineFeatures, build_feature_cache
from dspark.training.init import draft_vocabulary

LEVERS = {
    "baseline: full vocabulary, full q, online": {},
    "+ draft vocabulary 8192": {"draft_vocab_size": 8192},
    "+ target top-32": {"draft_vocab_size": 8192, "target_topk": 32},
    "+ feature cache": {"draft_vocab_size": 8192, "target_topk": 32, "feature_cache": True},
    "+ 16 anchors per sequence (instead of 64)": {
        "draft_vocab_size": 8192,
        "target_topk": 32,
        "feature_cache": True,
        "num_anchors": 16,
    },
}


def time_levers(
    data: str,
    model: str,
    base: dict,
    steps: int = 4,
    batch_size: int = 4,
    workdir: str = "runs/levers",
    levers: dict | None = None,
) -> list[dict]:
    from dspark.drafter import new_drafter
    from dspark.target import Target

    levers = levers or LEVERS
    cpu = torch.device("cpu")
    target = Target.load(model, dtype=TrainConfig(model=model, **base).for_device(cpu).target_dtype)
    rows = []
    for name, overrides in levers.items():
        settings = dict(base, **{k: v for k, v in overrides.items() if k != "feature_cache"})
        cfg = TrainConfig(data=data, out=workdir, model=model, batch_size=batch_size, **settings).for_device(cpu)
        train_set, _, _ = load_examples(target, data, cfg.max_length, holdout=0.0)
        batches = [train_set[i * batch_size : (i + 1) * batch_size] for i in range(steps + 1)]
        used = [e for b in batches for e in b]
        drafter = new_drafter(target, cfg.drafter_config()).float()
        if cfg.draft_vocab_size:
            drafter.set_draft_vocab(draft_vocabulary(train_set, cfg.draft_vocab_size, target.vocab_size)[0])
        source = OnlineFeatures(target, cfg.target_topk)
        if overrides.get("feature_cache"):
            cache = Path(workdir) / f"cache-{cfg.target_topk}"
            for i, e in enumerate(used):
                e.index = i
            if not (cache / "index.json").exists():
                build_feature_cache(cache, target, used, cfg.target_topk)
            source = CachedFeatures(cache)
        optimizer = torch.optim.AdamW(drafter.parameters(), lr=1e-4)
        gen = torch.Generator().manual_seed(0)
        t_target = t_drafter = 0.0
        positions = 0
        for i, batch_examples in enumerate(batches):
            t0 = time.perf_counter()
            batch = source(batch_examples)
            plan = plan_blocks(batch, cfg, gen)
            t1 = time.perf_counter()
            loss, _ = block_loss(drafter, batch, plan, cfg)  # includes q at the supervised positions
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            t2 = time.perf_counter()
            if i:  # the first batch warms up
                t_target += t1 - t0
                t_drafter += t2 - t1
                positions += int(plan.supervised.sum())
        rows.append(
            {
                "setting": name,
                "overrides": overrides,
                "ms_per_step": round(1000 * (t_target + t_drafter) / steps, 1),
                "features_ms_per_step": round(1000 * t_target / steps, 1),
                "loss_and_update_ms_per_step": round(1000 * t_drafter / steps, 1),
                "us_per_supervised_position": round(1e6 * (t_target + t_drafter) / max(1, positions), 1),
                "supervised_positions": positions,
                "target_dtype": cfg.target_dtype,
                "bf16_autocast": cfg.bf16,
            }
        )
    return rows


def levers_markdown(rows: list[dict], command: str) -> str:
    out = [
        *section_header("## Training cost by lever", command),
        f"Target in {rows[0]['target_dtype']}, drafter autocast to bfloat16 {'on' if rows[0]['bf16_autocast'] else 'off'}"
        " (chosen for this CPU, as `dspark train` does).",
        "",
        "| setting | ms / step | features ms | loss + update ms | µs / supervised position |",
        "| --- | --- | --- | --- | --- |",
    ]
    base = rows[0]["us_per_supervised_position"]
    for r in rows:
        out.append(
            f"| {r['setting']} | {r['ms_per_step']} | {r['features_ms_per_step']} | {r['loss_and_update_ms_per_step']} | "
            f"{r['us_per_supervised_position']} ({base / r['us_per_supervised_position']:.1f}x cheaper) |"
        )
    return "\n".join(out) + "\n"
