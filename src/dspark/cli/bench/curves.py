"""`dspark bench curves`: held-out τ against training time and tokens."""

from __future__ import annotations

import sys
from pathlib import Path

from dspark.cli.args import command_line, finite_float, parse_labelled, section_name
from dspark.errors import DSparkError
from dspark.fsutil import check_output_file, is_matplotlib_png


def register(sub) -> None:
    p = sub.add_parser("curves", help="plot held-out τ against training time and tokens for training runs")
    p.add_argument("--run", action="append", required=True, help="LABEL=RUN_FOLDER, repeatable")
    p.add_argument("--reference", help="label the others are compared with (default: the first --run)")
    p.add_argument("--out", required=True, help="PNG path")
    p.add_argument("--markdown", help="also write the comparison table as a section of this file (BENCHMARKS.md)")
    p.add_argument(
        "--at-tokens", type=finite_float, help="compare at this many training tokens (default: the furthest common)"
    )
    p.add_argument(
        "--at-minutes", type=finite_float, help="compare at this training time (default: the furthest common)"
    )
    p.add_argument(
        "--section",
        default="training-curves",
        type=section_name,
        help="name of the --markdown section to write (others are kept)",
    )
    p.add_argument("--title", default="Training curves: drafters trained alike", help="heading of that section")
    p.set_defaults(func=run)


def run(args) -> int:
    import os

    from dspark.bench.report import curves_table, training_curves, write_section

    runs = {}
    for label, path in parse_labelled(args.run, "--run", "dspark=runs/dspark").items():
        if not (Path(path) / "metrics.jsonl").is_file():
            raise DSparkError(f"--run {label}={path}: {path} has no metrics.jsonl (give a `dspark train` run folder)")
        runs[label] = Path(path)
    reference = args.reference or next(iter(runs))
    if reference not in runs:
        raise DSparkError(f"--reference '{reference}' is not one of the --run labels ({', '.join(runs)})")
    check_output_file(args.out, "--out", ours=is_matplotlib_png)
    if args.markdown:
        check_output_file(args.markdown, "--markdown")
    curves = training_curves(runs, Path(args.out))
    if not all(curves.values()):
        raise DSparkError(f"runs without a held-out evaluation yet: {', '.join(k for k, v in curves.items() if not v)}")
    markdown = Path(args.markdown) if args.markdown else None
    plot = os.path.relpath(args.out, markdown.parent) if markdown else str(args.out)
    table = curves_table(
        curves,
        reference,
        command_line(),
        plot,
        args.at_tokens,
        args.at_minutes * 60 if args.at_minutes else None,
        args.title,
    )
    print(table)
    if markdown:
        write_section(markdown, args.section, table)
        print(f"dspark: wrote {args.out} and the {args.section} section of {markdown}", file=sys.stderr)
    return 0
