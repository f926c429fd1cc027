"""`dspark import`: a speculators or DeepSpec drafter as a dspark checkpoint."""

from __future__ import annotations

import sys
from pathlib import Path

from dspark.cli.args import add_drafter_output_args, load_target
from dspark.errors import DSparkError


def register(sub) -> None:
    p = sub.add_parser("import", help="convert a speculators or DeepSpec DSpark drafter into a dspark checkpoint")
    p.add_argument("source", help="the drafter folder (config.json + safetensors)")
    p.add_argument("out", help="a new folder for the dspark checkpoint")
    add_drafter_output_args(p)
    p.set_defaults(func=run)


def run(args) -> int:
    from dspark.formats import import_drafter
    from dspark.fsutil import check_replaceable

    source, out = Path(args.source), Path(args.out)
    if not source.is_dir():
        raise DSparkError(f"{source} is not a folder; `dspark import` reads a speculators or DeepSpec drafter folder")
    check_replaceable(out, args.overwrite, source)
    fmt = import_drafter(source, out, load_target(args))
    print(
        f"dspark: imported the {fmt} drafter {source} into {out} (run `dspark calibrate` before scheduling with it)",
        file=sys.stderr,
    )
    return 0
