"""`dspark autotune`: measure this machine once for a target (precision, product forms, scheduler cost table)."""

from __future__ import annotations

import json
import sys

from dspark.cli.args import setup_torch, threads
from dspark.models import DEFAULT_TARGET


def register(sub) -> None:
    p = sub.add_parser(
        "autotune",
        help="measure this machine for a target: the precision --dtype auto picks, the "
        "product forms and the scheduler's cost table (cached; other commands do "
        "this on first use)",
    )
    p.add_argument("--model", default=DEFAULT_TARGET)
    p.add_argument("--threads", type=threads, default=0, help="torch CPU threads (0 = torch's default)")
    p.add_argument("--force", action="store_true", help="measure again, replacing what the cache holds")
    p.set_defaults(func=run)


def run(args) -> int:
    from dspark.autotune import autotune

    setup_torch(args)
    report = autotune(args.model, force=args.force, progress=lambda line: print(line, file=sys.stderr))
    print(json.dumps(report, indent=2))
    return 0
