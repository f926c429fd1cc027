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

    cfg, rank, world, device = start_process(cfg)
    out = Path(cfg.out)
    checkpoint = out / "checkpoint"

    target = Target.load(cfg.model, dtype=cfg.target_dtype, layer_ids=cfg.target_layer_ids or None, device=device)
    cfg = replace(cfg, target_layer_ids=list(target.layer_ids))  # the caller's config stays as it was given
    train_set, held_out, record_ids = load_examples(
        target, cfg.data, cfg.max_length, cfg.holdout, cfg.allow_foreign_data
    )
    decode_prompts = decode_eval_prompts(target, cfg) if rank == 0 else {}  # read now: a bad set fails at once

    drafter, ancestors = build_drafter(cfg, target, train_set)
    drafter.to(device).train()

    source = feature_source(cfg, target, train_set, rank, device)

    optimizer = torch.optim.AdamW(param_groups(drafter, cfg), lr=cfg.lr, betas=(0.9, 0.95))
    ddp_devices = [device] if device.type == "cuda" else None
    # The drafter's buffers are constants, equal on every rank: no need to sync them before each forward.
    model = DDP(drafter, device_ids=ddp_devices, forward_sync_buffers=False) if world > 1 else drafter

    steps_per_epoch = max(1, len(epoch_batches(train_set, cfg.batch_size, 0, cfg.seed)) // (world * cfg.grad_accum))
    total = cfg.max_steps if cfg.max_steps > 0 else max(1, int(cfg.epochs * steps_per_epoch))
    loop = {"step": 0, "epoch": 0, "batch": 0, "seconds": 0.0, "tokens": 0}
    if resume:
        loop, ancestors = resumed_loop(checkpoint, drafter, optimizer, total, record_ids, len(train_set), ancestors)
    loop["data"] = data_seen(record_ids, len(train_set))
    loop["device"] = device_name(device)
    cores = world * (1 if device.type == "cuda" else torch.get_num_threads())  # GPUs, or CPU threads
    loop.setdefault("core_seconds", loop["seconds"] * cores)

    metrics_file = open_metrics(out, loop["step"], resume) if rank == 0 else None
    show = progress and rank == 0
    bar = tqdm(total=total, initial=loop["step"], desc="train", unit="step", disable=not show, dynamic_ncols=True)
    start = time.perf_counter() - loop["seconds"]
    batches = epoch_batches(train_set, cfg.batch_size, loop["epoch"], cfg.seed)
    last: dict = {}
    minutes_fit = MinutesFit(loop["step"], total, cfg.max_minutes, device)
    step_seconds = 0.0  # this invocation's steps: not loading, evaluations, checkpoints
    while loop["step"] < total:
        step_started = time.perf_counter()
        micro, batches = next_micro_batches(loop, batches, train_set, cfg, rank, world)
        lr = lr_at(loop["step"], total, cfg)
        step_metrics = optimizer_step(model, drafter, optimizer, source, micro, cfg, lr, loop, world, device)
        loop["step"] += 1
        if loop["step"] % 10 == 0:
            return_freed_memory()
        step_seconds += time.perf_counter() - step_started
        if cfg.max_minutes and (fit := minutes_fit.after_step(loop["step"], step_seconds)):
            per_step, total = fit
            cfg = replace(cfg, max_steps=total)  # saved with the checkpoints, so a plain --resume keeps the schedule
            bar.total = total
            if rank == 0:
                bar.write(f"dspark: {per_step:.2f} s a step: {total} steps fit --max-minutes {cfg.max_minutes:g}")
        elapsed = time.perf_counter() - start
        loop["core_seconds"] += (elapsed - loop["seconds"]) * cores
        loop["seconds"] = elapsed
        last = {"step": loop["step"], "epoch": loop["epoch"], "lr": lr, "seconds": round(elapsed, 1)}
        last.update(tokens=loop["tokens"], **step_metrics)
        bar.update(1)
        bar.set_postfix({k: f"{v:.3f}" for k, v in step_metrics.items() if k != "grad_norm"})
        if rank == 0:
            last.update(evaluations(drafter, target, held_out, decode_prompts, cfg, loop["step"], total, bar.write))
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


def start_process(cfg: TrainConfig) -> tuple[TrainConfig, int, int, torch.device]:
    """This process's rank, the number of ranks and its device (torchrun's, or one process alone), the config for that
    device, and its seeds; only rank 0 reports."""
    rank, world, device = init_distributed(cfg.device)
    cfg = cfg.for_device(device)
    if rank > 0:
        log.setLevel(logging.WARNING)
    log.info(
        f"target in {cfg.target_dtype}, drafter autocast to bfloat16 {'on' if cfg.bf16 else 'off'}, "
        f"{device_name(device)}"
    )
    torch.manual_seed(cfg.seed + rank)
    random.seed(cfg.seed + rank)
    return cfg, rank, world, device


def feature_source(cfg: TrainConfig, target, train_set, rank: int, device):
    """The target's features for each batch: computed online, or read from the feature cache (built, or extended by
    appended examples, by rank 0 while the others wait)."""
    if not cfg.feature_cache:
        return OnlineFeatures(target, cfg.target_topk)
    cache = Path(cfg.feature_cache)
    if rank == 0:
        build_feature_cache(cache, target, train_set, cfg.target_topk)
    barrier()
    source = CachedFeatures(cache, device)
    source.check(train_set, target, cfg.target_topk)
    return source


def open_metrics(out: Path, step: int, resume: bool):
    """The run's metrics log, opened for appending; a resumed run first drops the lines past its checkpoint's step.
    The folder is made only now: a run that fails on its inputs leaves none behind."""
    out.mkdir(parents=True, exist_ok=True)
    if resume:
        keep_metrics_up_to(out / "metrics.jsonl", step)
    return (out / "metrics.jsonl").open("a")


def resumed_loop(checkpoint: Path, drafter, optimizer, total: int, record_ids, examples: int, ancestors):
    """The loop state (and lineage) a checkpoint holds, the drafter and optimizer restored from it; a schedule it has
    already finished is refused, and examples appended to the data since join from the next epoch."""
    recover_dir(checkpoint)
    if not (checkpoint / "trainer_state.json").exists():
        raise DSparkError(f"nothing to resume: {checkpoint} has no trainer state")
    loop, saved = load_checkpoint(checkpoint, drafter, optimizer)
    if loop["step"] >= total:
        where = "the end" if loop["step"] == total else "past the end"
        raise DSparkError(
            f"the checkpoint in {checkpoint} is at step {loop['step']}, {where} of a schedule of {total} steps: "
            f"nothing to train. Pass --max-steps above {loop['step']} to go on"
        )
    # The lineage as at the run's start, even if --init-from has been overwritten since; checkpoints written
    # before the lineage existed keep the one just read from --init-from.
    ancestors = read_checkpoint_meta(checkpoint).get("lineage", ancestors)
    appended = continue_on_data(loop, record_ids, examples, saved.get("data"))
    if appended > 0:
        loop["epoch"], loop["batch"] = loop["epoch"] + 1, 0
        log.info(f"{appended} training examples appended since the checkpoint; they join from epoch {loop['epoch']} on")
    return loop, ancestors


def next_micro_batches(loop: dict, batches, train_set, cfg: TrainConfig, rank: int, world: int):
    """This rank's grad_accum micro-batches of the step, each with its anchors' generator, moving on to the next
    epoch's shuffle when this one runs out. Returns them and the epoch's batches."""
    micro = []
    for _ in range(cfg.grad_accum):
        if loop["batch"] + world > len(batches):
            loop["epoch"], loop["batch"] = loop["epoch"] + 1, 0
            batches = epoch_batches(train_set, cfg.batch_size, loop["epoch"], cfg.seed)
        index = loop["batch"] + rank
        micro.append(([train_set[i] for i in batches[index]], anchor_generator(cfg.seed, loop["epoch"], index)))
        loop["batch"] += world
    return micro, batches


def optimizer_step(model, drafter, optimizer, source, micro, cfg: TrainConfig, lr: float, loop, world, device) -> dict:
    """One optimizer step over the micro-batches: features, anchored blocks, the loss and its gradients (each
    micro-batch's loss a weighted mean over every supervised position of the whole step, all ranks), clipping, the
    learning rate, AdamW. Counts the step's tokens into loop; returns the step's metrics and its gradient norm."""
    optimizer.zero_grad(set_to_none=True)
    prepared = [source(m) for m, _ in micro]
    plans = [plan_blocks(b, cfg, g, drafter) for b, (_, g) in zip(prepared, micro)]
    local = torch.stack(
        [
            sum(p.weights.sum() for p in plans).float().cpu(),
            torch.tensor(float(sum(int(b.loss_mask.sum()) for b in prepared))),
        ]
    )
    denominator, step_tokens = all_sum(local).tolist()
    metrics: dict[str, float] = {}
    for i, (batch, plan) in enumerate(zip(prepared, plans)):
        # DDP all-reduces gradients on the last micro-batch only; the others accumulate locally.
        sync = i == len(prepared) - 1 or world == 1
        with contextlib.nullcontext() if sync else model.no_sync():
            loss, parts = block_loss(model, batch, plan, cfg, torch.tensor(denominator, device=device))
            (loss * world).backward()  # DDP averages gradients over ranks; the denominator is already global
        for k, v in parts.items():
            metrics[k] = metrics.get(k, 0.0) + v
    loop["tokens"] += int(step_tokens)
    params = [p for p in drafter.parameters() if p.requires_grad]
    grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.clip)
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_scale", 1.0)
    optimizer.step()
    return {"grad_norm": float(grad_norm), **metrics}


class MinutesFit:
    """--max-minutes: after 10, 20, 40 ... steps of this invocation, the schedule is fitted again to the time the
    steps took since the last fit (the first step also warms up: allocations, kernels; it is not timed). A refit may
    lengthen the schedule again, never beyond the steps first asked for."""

    def __init__(self, first_step: int, asked_steps: int, minutes: float, device):
        self.first_step, self.asked_steps, self.minutes, self.device = first_step, asked_steps, minutes, device
        self.fitted_at: tuple[int, float] | None = None  # (steps, step seconds) when last measured from

    def after_step(self, step: int, step_seconds: float) -> tuple[float, int] | None:
        """(seconds a step, the schedule's new total) when this step refits, else None."""
        done = step - self.first_step
        self.fitted_at = self.fitted_at or (done, step_seconds)
        if not (done % FIT_AFTER_STEPS == 0 and (done // FIT_AFTER_STEPS).bit_count() == 1):
            return None
        per_step = (step_seconds - self.fitted_at[1]) / (done - self.fitted_at[0])
        self.fitted_at = (done, step_seconds)
        return per_step, fit_to_minutes(self.asked_steps, step, per_step, self.minutes * 60 - step_seconds, self.device)


def evaluations(drafter, target, held_out, decode_prompts, cfg: TrainConfig, step: int, total: int, write) -> dict:
    """The evaluations due at this step: held-out τ every eval_every steps, real decoding every decode_eval_every
    (and both at the last step); a line of each is written."""
    due = {}
    if held_out and (step % cfg.eval_every == 0 or step == total):
        due.update(evaluate(drafter, OnlineFeatures(target, 0), spread_slice(held_out, 64), cfg, cfg.batch_size))
        keys = ("tau_greedy", "tau_rounds", "accept_by_position", "tau_by_source")
        write(json.dumps({"step": step, **{k: due[k] for k in keys if k in due}}))
    if cfg.decode_eval_every > 0 and (step % cfg.decode_eval_every == 0 or step == total):
        due.update(decode_eval(drafter, target, decode_prompts, cfg.decode_eval_tokens))
        write(json.dumps({"step": step, **{k: due[k] for k in ("decode_tau", "decode_tau_all")}}))
    return due
