"""`dspark bench train`: the cost of a training step under each efficiency lever."""

from __future__ import annotations

import json
from pathlib import Path

from dspark.cli.args import command_line, nonnegative_int, positive_int, setup_torch, threads
from dspark.cli.bench import add_output_args
from dspark.fsutil import check_output_dir, check_output_file
from dspark.models import DEFAULT_TARGET


def register(sub) -> None:
    p = sub.add_parser("train", help="cost of a training step under each efficiency lever")
    p.add_argument("--data", required=True, help="regenerated JSONL")
    p.add_argument("--model", default=DEFAULT_TARGET)
    p.add_argument("--threads", type=threads, default=0)
    p.add_argument("--steps", type=positive_int, default=4)
    p.add_argument("--batch-size", type=positive_int, default=4)
    p.add_argument("--markov-rank", type=nonnegative_int, default=64)
    add_output_args(p)
    p.set_defaults(func=run)


def run(args) -> int:
    from dspark.bench.report import write_section
    from dspark.bench.training import levers_markdown, time_levers
    from dspark.fsutil import atomic_write_json, atomic_write_text

    out = check_output_dir(args.out, "--out")
    if args.markdown:
        check_output_file(args.markdown, "--markdown")
    setup_torch(args)
    base = dict(markov_rank=args.markov_rank, num_anchors=64)
    rows = time_levers(args.data, args.model, base, steps=args.steps, batch_size=args.batch_size)
    command = command_line()
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out / "training-levers.json", {"command": command, "rows": rows})
    atomic_write_text(out / "training-levers.md", levers_markdown(rows, command) + "\n")
    if args.markdown:
        write_section(Path(args.markdown), "training-levers", levers_markdown(rows, command))
    for r in rows:
        print(json.dumps(r))
    return 0
