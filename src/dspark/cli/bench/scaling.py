"""`dspark bench scaling`: real τ of a drafter's legs against training compute, fitted."""

from __future__ import annotations

import math
from pathlib import Path

from dspark.cli.args import section_name
from dspark.cli.bench import add_output_args, publish
from dspark.errors import DSparkError
from dspark.fsutil import check_output_dir, check_output_file


def register(sub) -> None:
    p = sub.add_parser(
        "scaling",
        help="real τ of a drafter's legs against its cumulative training compute, fitted and extrapolated to a goal τ",
    )
    p.add_argument("--signal", nargs="+", required=True, help="bench signal result JSONs, one per drafter (leg)")
    p.add_argument(
        "--goal",
        nargs="+",
        default=["3"],
        help="the τ to extrapolate to: for every set (3) and/or per set (mt-bench=2)",
    )
    p.add_argument("--name", default="scaling", type=section_name, help="name of the result files and section")
    add_output_args(p)
    p.set_defaults(func=run)


def run(args) -> int:
    from dspark.bench.scaling import read_point, scaling_plot, scaling_section, scaling_table

    goals = {"*": 3.0}
    for item in args.goal:
        name, _, value = item.rpartition("=")
        try:
            goal = float(value)
        except ValueError:
            goal = math.nan
        if not goal > 1:
            raise DSparkError(
                f"--goal {item}: a goal is a τ above 1 (1 + accepted drafts per round), for every set "
                "(3) or for one (mt-bench=2)"
            )
        goals[name or "*"] = goal
    out = check_output_dir(args.out, "--out")
    if args.markdown:
        check_output_file(args.markdown, "--markdown")
    points = [read_point(Path(p)) for p in args.signal]
    if len({p.tokens for p in points}) < 2:
        raise DSparkError(
            "--signal: give `dspark bench signal` runs of at least two drafters trained for different amounts "
            "(a fit needs two points)"
        )
    run = {
        "goals": goals,
        "points": [vars(p) for p in sorted(points, key=lambda p: p.tokens)],
        "rows": scaling_table(points, goals),
    }
    publish(
        run,
        out,
        args.name,
        lambda: scaling_plot(run, out / f"{args.name}.png"),
        lambda run_, command, plot: scaling_section(run_, command, plot, args.name),
        args.markdown,
    )
    return 0
