"""`dspark export`: a drafter in another precision or format."""

from __future__ import annotations

import sys
from pathlib import Path

from dspark.cli.args import add_drafter_output_args, gguf_arg, load_target
from dspark.formats import EXPORT_FORMATS


def register(sub) -> None:
    p = sub.add_parser(
        "export",
        help="write a drafter in another precision or format (speculators for vLLM, deepspec, gguf for llama.cpp)",
    )
    p.add_argument("checkpoint")
    p.add_argument("out", help="a new folder (the model card, and for dspark the calibration, travel with the weights)")
    p.add_argument(
        "--format",
        choices=EXPORT_FORMATS,
        default="dspark",
        help="dspark (default), speculators (vLLM --speculative-config), deepspec, gguf (llama.cpp "
        "--spec-type draft-dspark); see docs/formats.md",
    )
    p.add_argument(
        "--target-gguf",
        help="--format gguf: the target's GGUF, whose vocabulary the draft copies "
        "(default: the file a known target's package carries)",
    )
    add_drafter_output_args(p)
    p.set_defaults(func=run)


def run(args) -> int:
    from dspark.drafter import load_drafter, read_checkpoint_meta
    from dspark.formats import export_drafter
    from dspark.fsutil import check_replaceable
    from dspark.target import parse_dtype

    source, out = Path(args.checkpoint), Path(args.out)
    meta = read_checkpoint_meta(source)
    check_replaceable(out, args.overwrite, source)
    target = load_target(args)
    drafter = load_drafter(source, target)
    target_gguf = gguf_arg(args.target_gguf, args.model) if args.format == "gguf" else None
    carried = export_drafter(source, out, args.format, drafter, target, parse_dtype(args.dtype), meta, target_gguf)
    note = f", with {', '.join(carried)}" if carried else ""
    if args.format == "dspark" and "calibration.json" not in carried:
        note += ", no calibration.json to carry (run `dspark calibrate`)"
    print(f"dspark: wrote {out} ({args.format}, {args.dtype}){note}", file=sys.stderr)
    if args.format == "gguf":
        draft = next(out.glob("*.gguf"))
        print(
            f"run it with llama.cpp:\n  llama-server -m {target_gguf} -md {draft} --spec-type draft-dspark "
            f"--spec-draft-n-max {drafter.block_size}",
            file=sys.stderr,
        )
    return 0
