"""`dspark train`: the drafter's training loop, read top to bottom (docs/design.md §3). What it calls lives beside it:
config (the run's settings), init (where the drafter starts), batches (examples, anchored blocks, loss),
evaluation, checkpoint, schedule, runtime (DDP, devices). It reports through the `dspark.train` logger.

Per step: a batch of sequences -> target features (online, or from the feature cache) -> anchors and supervised
block positions -> the drafter's forward over all blocks -> the three-term loss -> AdamW with warmup + cosine.
Runs alone or under torchrun (DDP; gloo on CPU). Checkpoints are atomic and hold everything `--resume` needs to
continue exactly: weights, optimizer moments, schedule position, random state and data position. No pickle.
"""

from __future__ import annotations

import contextlib
import json
import logging
import random
import time
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm import tqdm

from dspark.drafter import read_checkpoint_meta
from dspark.errors import DSparkError
from dspark.fsutil import recover_dir
from dspark.records import spread_slice
from dspark.training.batches import (
    anchor_generator,
    block_loss,
    continue_on_data,
    data_seen,
    epoch_batches,
    load_examples,
    plan_blocks,
)
from dspark.training.checkpoint import keep_metrics_up_to, load_checkpoint, save_checkpoint
from dspark.training.config import TrainConfig
from dspark.training.evaluation import decode_eval, decode_eval_prompts, evaluate
from dspark.training.features import CachedFeatures, OnlineFeatures, build_feature_cache
from dspark.training.init import build_drafter, param_groups
from dspark.training.runtime import all_sum, barrier, device_name, init_distributed, return_freed_memory
from dspark.training.schedule import FIT_AFTER_STEPS, fit_to_minutes, lr_at

log = logging.getLogger("dspark.train")


def train(cfg: TrainConfig, resume: bool = False, progress: bool = True) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from dspark.target import Target

    rank, world, device = init_distributed(cfg.device)
    cfg = cfg.for_device(device)
    if rank > 0:
        log.setLevel(logging.WARNING)  # one rank reports
    log.info(
        f"target in {cfg.target_dtype}, drafter autocast to bfloat16 {'on' if cfg.bf16 else 'off'}, "
        f"{device_name(device)}"
    )
    out = Path(cfg.out)
    checkpoint = out / "checkpoint"
    torch.manual_seed(cfg.seed + rank)
    random.seed(cfg.seed + rank)

    target = Target.load(cfg.model, dtype=cfg.target_dtype, layer_ids=cfg.target_layer_ids or None, device=device)
    cfg = replace(cfg, target_layer_ids=list(target.layer_ids))  # the caller's config stays as it was given
    train_set, held_out, record_ids = load_examples(
        target, cfg.data, cfg.max_length, cfg.holdout, cfg.allow_foreign_data
    )
    decode_prompts = decode_eval_prompts(target, cfg) if rank == 0 else {}  # read now: a bad set fails at once

    drafter, ancestors = build_drafter(cfg, target, train_set)
    drafter.to(device).train()

    source = OnlineFeatures(target, cfg.target_topk)
    if cfg.feature_cache:
        cache = Path(cfg.feature_cache)
        if rank == 0:
            build_feature_cache(cache, target, train_set, cfg.target_topk)  # or extend it by appended examples
        barrier()
        source = CachedFeatures(cache, device)
        source.check(train_set, target, cfg.target_topk)

    params = [p for p in drafter.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(param_groups(drafter, cfg), lr=cfg.lr, betas=(0.9, 0.95))
    ddp_devices = [device] if device.type == "cuda" else None
    # The drafter's buffers are constants, equal on every rank: no need to sync them before each forward.
    model = DDP(drafter, device_ids=ddp_devices, forward_sync_buffers=False) if world > 1 else drafter

    steps_per_epoch = max(1, len(epoch_batches(train_set, cfg.batch_size, 0, cfg.seed)) // (world * cfg.grad_accum))
    total = cfg.max_steps if cfg.max_steps > 0 else max(1, int(cfg.epochs * steps_per_epoch))
    loop = {"step": 0, "epoch": 0, "batch": 0, "seconds": 0.0, "tokens": 0}
    if resume:
        recover_dir(checkpoint)
        if not (checkpoint / "trainer_state.json").exists():
            raise DSparkError(f"nothing to resume: {checkpoint} has no trainer state")
        loop, saved = load_checkpoint(checkpoint, drafter, optimizer)
        if loop["step"] >= total:
            raise DSparkError(
                f"the checkpoint in {checkpoint} is at step {loop['step']}, {'the end' if loop['step'] == total else 'past the end'} "
                f"of a schedule of {total} steps: nothing to train. Pass --max-steps above "
                f"{loop['step']} to go on"
            )
        # The lineage as at the run's start, even if --init-from has been overwritten since; checkpoints written
        # before the lineage existed keep the one just read from --init-from.
        ancestors = read_checkpoint_meta(checkpoint).get("lineage", ancestors)
        appended = continue_on_data(loop, record_ids, len(train_set), saved.get("data"))
        if appended > 0:
            loop["epoch"], loop["batch"] = loop["epoch"] + 1, 0
            log.info(
                f"{appended} training examples appended since the checkpoint; they join from epoch {loop['epoch']} on"
            )
    loop["data"] = data_seen(record_ids, len(train_set))
    loop["device"] = device_name(device)
    cores = world * (1 if device.type == "cuda" else torch.get_num_threads())  # GPUs, or CPU threads
    loop.setdefault("core_seconds", loop["seconds"] * cores)

    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)  # only now: a run that fails on its inputs leaves no folder behind
    if rank == 0 and resume:
        keep_metrics_up_to(out / "metrics.jsonl", loop["step"])
    metrics_file = (out / "metrics.jsonl").open("a") if rank == 0 else None
    bar = tqdm(
        total=total,
        initial=loop["step"],
        desc="train",
        unit="step",
        disable=not progress or rank > 0,
        dynamic_ncols=True,
    )
    start = time.perf_counter() - loop["seconds"]
    batches = epoch_batches(train_set, cfg.batch_size, loop["epoch"], cfg.seed)
    last = {}
    fit_from = loop["step"]  # --max-minutes counts this invocation's steps: not loading, evaluations, checkpoints
    asked_steps = total  # a refit may lengthen the schedule again, never beyond this
    step_seconds = 0.0
    fitted_at = None  # (steps, step seconds) of this invocation when the step time was last measured from
    while loop["step"] < total:
        step_started = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        micro = []
        for _ in range(cfg.grad_accum):
            if loop["batch"] + world > len(batches):
                loop["epoch"] += 1
                loop["batch"] = 0
                batches = epoch_batches(train_set, cfg.batch_size, loop["epoch"], cfg.seed)
            index = loop["batch"] + rank
            micro.append(([train_set[i] for i in batches[index]], anchor_generator(cfg.seed, loop["epoch"], index)))
            loop["batch"] += world
        # Each micro-batch's loss is a weighted mean over every supervised position of the whole step, all ranks.
        prepared = [source(m) for m, _ in micro]
        plans = [plan_blocks(b, cfg, g, drafter) for b, (_, g) in zip(prepared, micro)]
        local = torch.stack(
            [
                sum(p.weights.sum() for p in plans).float().cpu(),
                torch.tensor(float(sum(int(b.loss_mask.sum()) for b in prepared))),
            ]
        )
        denominator, step_tokens = all_sum(local).tolist()
        step_metrics = {}
        for i, (batch, plan) in enumerate(zip(prepared, plans)):
            # DDP all-reduces gradients on the last micro-batch only; the others accumulate locally.
            sync = i == len(prepared) - 1 or world == 1
            with contextlib.nullcontext() if sync else model.no_sync():
                loss, metrics = block_loss(model, batch, plan, cfg, torch.tensor(denominator, device=device))
                (loss * world).backward()  # DDP averages gradients over ranks; the denominator is already global
            for k, v in metrics.items():
                step_metrics[k] = step_metrics.get(k, 0.0) + v
        loop["tokens"] += int(step_tokens)
        grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.clip)
        lr = lr_at(loop["step"], total, cfg)
        for group in optimizer.param_groups:
            group["lr"] = lr * group.get("lr_scale", 1.0)
        optimizer.step()
        loop["step"] += 1
        if loop["step"] % 10 == 0:
            return_freed_memory()
        step_seconds += time.perf_counter() - step_started
        done_here = loop["step"] - fit_from
        fitted_at = fitted_at or (
            done_here,
            step_seconds,
        )  # the first step also warms up (allocations, kernels): not timed
        refit = done_here % FIT_AFTER_STEPS == 0 and (done_here // FIT_AFTER_STEPS).bit_count() == 1  # 10, 20, 40 ...
        if cfg.max_minutes and refit:
            per_step = (step_seconds - fitted_at[1]) / (done_here - fitted_at[0])
            fitted_at = (done_here, step_seconds)
            total = fit_to_minutes(asked_steps, loop["step"], per_step, cfg.max_minutes * 60 - step_seconds, device)
            cfg = replace(cfg, max_steps=total)  # saved with the checkpoints, so a plain --resume keeps the schedule
            bar.total = total
            if rank == 0:
                bar.write(f"dspark: {per_step:.2f} s a step: {total} steps fit --max-minutes {cfg.max_minutes:g}")
        elapsed = time.perf_counter() - start
        loop["core_seconds"] += (elapsed - loop["seconds"]) * cores
        loop["seconds"] = elapsed
        last = {
            "step": loop["step"],
            "epoch": loop["epoch"],
            "lr": lr,
            "grad_norm": float(grad_norm),
            "seconds": round(loop["seconds"], 1),
            "tokens": loop["tokens"],
            **step_metrics,
        }
        bar.update(1)
        bar.set_postfix({k: f"{v:.3f}" for k, v in step_metrics.items()})
        due_eval = loop["step"] % cfg.eval_every == 0 or loop["step"] == total
        if due_eval and rank == 0 and held_out:
            last.update(evaluate(drafter, OnlineFeatures(target, 0), spread_slice(held_out, 64), cfg, cfg.batch_size))
            bar.write(
                json.dumps(
                    {
                        k: last[k]
                        for k in ("step", "tau_greedy", "tau_rounds", "accept_by_position", "tau_by_source")
                        if k in last
                    }
                )
            )
        due_decode = cfg.decode_eval_every > 0 and (loop["step"] % cfg.decode_eval_every == 0 or loop["step"] == total)
        if due_decode and rank == 0:
            last.update(decode_eval(drafter, target, decode_prompts, cfg.decode_eval_tokens))
            bar.write(json.dumps({k: last[k] for k in ("step", "decode_tau", "decode_tau_all")}))
        if rank == 0:
            metrics_file.write(json.dumps(last) + "\n")
            metrics_file.flush()
        if loop["step"] % cfg.save_every == 0 or loop["step"] == total:
            if rank == 0:
                save_checkpoint(checkpoint, drafter, optimizer, loop, target.identity(), cfg, ancestors)
            barrier()
    bar.close()
    if metrics_file:
        metrics_file.close()
    if dist.is_initialized():
        dist.destroy_process_group()
    return last
