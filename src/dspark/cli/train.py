"""`dspark train`: train a drafter (alone or under torchrun)."""

from __future__ import annotations

import json
from pathlib import Path

from dspark.cli.args import add_config_flags, check_drafter_arg, setup_torch, threads
from dspark.errors import DSparkError
from dspark.fsutil import check_input_file, check_output_dir


def register(sub) -> None:
    from dspark.training.config import TrainConfig

    p = sub.add_parser("train", help="train a drafter for a target (alone or under torchrun)")
    p.add_argument("--out", required=True, help="run folder: checkpoint/, metrics.jsonl")
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue the run in --out exactly where it stopped; only how long it runs may change, and --data "
        "may name a file that appends records to what the run saw (they join from the next epoch)",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--threads", type=threads, default=0)
    add_config_flags(p, TrainConfig, skip=("out",))
    p.set_defaults(func=run)


def run(args) -> int:
    from dataclasses import fields

    from dspark.training.config import TrainConfig, resumed_config
    from dspark.training.trainer import train

    given = {f.name: getattr(args, f.name) for f in fields(TrainConfig) if getattr(args, f.name, None) is not None}
    if args.resume:
        given.pop("out")
        cfg = resumed_config(args.out, given)
    else:
        if not args.data:
            raise DSparkError("--data is required (regenerated JSONL from `dspark regenerate`)")
        cfg = TrainConfig(**given)
        check_input_file(cfg.data, "--data")
        if (Path(cfg.out) / "checkpoint").exists():
            raise DSparkError(f"{cfg.out} already holds a run; continue it with --resume, or choose a new --out")
    if cfg.init_from:
        check_drafter_arg(cfg.init_from)
    check_output_dir(cfg.out, "--out", inputs=[p for p in (cfg.data, cfg.init_from) if p])
    setup_torch(args)
    result = train(cfg, resume=args.resume, progress=not args.quiet)
    print(json.dumps(result))
    return 0
