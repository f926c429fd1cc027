"""Checkpoints: everything `--resume` needs, written atomically as JSON and safetensors (no pickle), checked field by
field when read."""

from __future__ import annotations

import json
import math
import os
import random
from dataclasses import asdict
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from dspark.errors import DSparkError
from dspark.fsutil import atomic_dir, atomic_write_text
from dspark.training.config import TrainConfig


# ---- checkpoints --------------------------------------------------------------------------------------------------
def save_checkpoint(
    path: Path, drafter, optimizer, state: dict, target_identity: dict, cfg: TrainConfig, ancestors: list[dict]
) -> None:
    """Drafter (loadable by `dspark generate --drafter`) + optimizer + loop state + the legs it was continued from,
    swapped in atomically."""
    opt = optimizer.state_dict()
    tensors = {f"state.{i}.{k}": v.detach().cpu().contiguous() for i, s in opt["state"].items() for k, v in s.items()}
    tensors["rng.torch"] = torch.get_rng_state()
    if torch.cuda.is_available():
        tensors["rng.cuda"] = torch.cuda.get_rng_state()
    version, internal, gauss = random.getstate()
    meta = {
        "param_groups": opt["param_groups"],
        "loop": state,
        "python_rng": [version, list(internal), gauss],
        "train_config": asdict(cfg),
    }
    with atomic_dir(path) as tmp:
        drafter.save(
            tmp / "drafter", target_identity, extra={"training": asdict(cfg), "progress": state, "lineage": ancestors}
        )
        for name in ("config.json", "model.safetensors"):  # the checkpoint folder itself loads as a drafter
            os.link(tmp / "drafter" / name, tmp / name)
        save_file(tensors, str(tmp / "trainer_state.safetensors"))
        (tmp / "trainer_state.json").write_text(json.dumps(meta, indent=1))


def load_checkpoint(path: Path, drafter, optimizer) -> tuple[dict, dict]:
    """Everything save_checkpoint wrote, back in place; returns the loop state and the run's configuration as saved.
    The trainer state is plain JSON and tensors: nothing in it is ever evaluated or unpickled."""
    try:
        drafter.load_state_dict(load_file(str(path / "model.safetensors")))
        meta = json.loads((path / "trainer_state.json").read_text())
        tensors = load_file(str(path / "trainer_state.safetensors"))
    except (OSError, ValueError, RuntimeError) as e:
        raise DSparkError(f"{path} is damaged and cannot be resumed ({e}); restart the run without --resume") from e
    check_trainer_state(meta, optimizer, path / "trainer_state.json")
    state = {}
    for key, value in tensors.items():
        if key.startswith("state."):
            _, idx, name = key.split(".", 2)
            if not idx.isdigit() or int(idx) >= sum(len(g["params"]) for g in meta["param_groups"]):
                raise DSparkError(
                    f"{path}/trainer_state.safetensors: optimizer state for parameter {idx}, which "
                    "this drafter does not have; the checkpoint is damaged (restart without --resume)"
                )
            state.setdefault(int(idx), {})[name] = value
    optimizer.load_state_dict({"state": state, "param_groups": meta["param_groups"]})
    torch.set_rng_state(tensors["rng.torch"])
    if "rng.cuda" in tensors and torch.cuda.is_available():
        torch.cuda.set_rng_state(tensors["rng.cuda"])
    random.setstate(python_rng_state(meta.get("python_rng"), path))
    return meta["loop"], meta["train_config"]


def check_trainer_state(meta, optimizer, where: Path) -> None:
    """Every field the loop and the optimizer read, checked against this run before anything is loaded."""

    def damaged(what: str):
        return DSparkError(f"{where}: {what}; the checkpoint is damaged or edited (restart the run without --resume)")

    if not isinstance(meta, dict) or not isinstance(meta.get("loop"), dict):
        raise damaged("it holds no loop state")
    loop = meta["loop"]
    for key in ("step", "epoch", "batch", "tokens"):
        if type(loop.get(key)) is not int or loop[key] < 0:
            raise damaged(f"loop.{key} must be a non-negative integer, got {loop.get(key)!r}")
    for key in ("seconds", "core_seconds"):
        value = loop.get(key, 0.0)
        if type(value) not in (int, float) or not math.isfinite(value) or value < 0:
            raise damaged(f"loop.{key} must be a non-negative number, got {value!r}")
    if not isinstance(meta.get("train_config"), dict):
        raise damaged("train_config is missing")
    groups, mine = meta.get("param_groups"), optimizer.state_dict()["param_groups"]
    if not isinstance(groups, list) or len(groups) != len(mine):
        raise damaged(
            f"it has {len(groups) if isinstance(groups, list) else 'no'} parameter groups, this drafter {len(mine)}"
        )
    for i, (saved, ours) in enumerate(zip(groups, mine)):
        if not isinstance(saved, dict) or saved.get("params") != ours["params"]:
            raise damaged(f"parameter group {i} does not hold this drafter's parameters")
        for key in ("lr", "weight_decay", "lr_scale", "eps"):
            value = saved.get(key, ours.get(key, 0.0))
            if type(value) not in (int, float) or not math.isfinite(value) or value < 0:
                raise damaged(f"parameter group {i}: {key} must be a non-negative number, got {value!r}")
        betas = saved.get("betas")
        if not (
            isinstance(betas, list) and len(betas) == 2 and all(type(b) in (int, float) and 0 <= b < 1 for b in betas)
        ):
            raise damaged(f"parameter group {i}: betas must be two numbers in [0, 1), got {betas!r}")


def keep_metrics_up_to(path: Path, step: int) -> None:
    """A resumed run replays the steps after its checkpoint: drop their lines (and a torn last line) first."""
    if not path.is_file():
        return
    kept = []
    for line in path.read_text(encoding="utf-8", errors="replace").split("\n"):
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int) and record["step"] <= step:
            kept.append(line)
    atomic_write_text(path, "".join(line + "\n" for line in kept))


def python_rng_state(data, path) -> tuple:
    """Python's random state from its JSON form [version, [625 ints], gauss-or-null], checked field by field."""
    ok = (
        isinstance(data, list)
        and len(data) == 3
        and type(data[0]) is int
        and isinstance(data[1], list)
        and len(data[1]) == 625
        and all(type(x) is int for x in data[1])
        and (data[2] is None or isinstance(data[2], float))
    )
    if not ok:
        raise DSparkError(
            f"{path}/trainer_state.json: python_rng is not a random-generator state; the checkpoint "
            "is damaged or was written by an older dspark (restart the run without --resume)"
        )
    return data[0], tuple(data[1]), data[2]
