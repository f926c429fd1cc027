"""`dspark bench KIND`: the benchmarks, one module each. Every one writes its JSON result, plot and a readable
report (NAME.md) into --out; it writes a section of a markdown file (BENCHMARKS.md) only when --markdown names one."""

from __future__ import annotations

import sys
from importlib import import_module
from pathlib import Path

from dspark.cli.args import check_drafter_arg, command_line, is_plain_name
from dspark.errors import DSparkError
from dspark.fsutil import check_output_dir, check_output_file

KINDS = (
    "speed",
    "engine",
    "quality",
    "serve",
    "clients",
    "signal",
    "suffix",
    "train",
    "llama_cpp",
    "scaling",
    "curves",
)


def register(sub) -> None:
    p = sub.add_parser(
        "bench",
        help="benchmarks: speed, engine, race, quality, serve, clients, signal, suffix, train, llama-cpp, scaling, "
        "curves (each writes JSON, a plot and a report into --out)",
    )
    kinds = p.add_subparsers(dest="kind", required=True, metavar="KIND")
    for kind in KINDS:
        import_module(f"dspark.cli.bench.{kind}").register(kinds)


def add_output_args(p) -> None:
    p.add_argument("--out", default="bench", help="folder for the JSON result, the plots and the report (NAME.md)")
    p.add_argument(
        "--markdown",
        help="also write the section into this markdown file (BENCHMARKS.md); by default only --out is written",
    )


def check_bench_args(args, drafters) -> Path:
    """A benchmark's drafters, evaluation sets and output paths, refused before any model loads. Returns --out."""
    from dspark.assets import eval_path

    name = getattr(args, "name", "x")
    if not is_plain_name(name):
        raise DSparkError(
            f"--name {name!r} must be a plain name (letters, digits, '.', '_', '-'): it names the "
            "result files inside --out and a section of the markdown file"
        )
    for path in drafters:
        check_drafter_arg(path)
    for name in getattr(args, "datasets", []):
        eval_path(name)
    if args.markdown:
        check_output_file(args.markdown, "--markdown")
    return check_output_dir(args.out, "--out", inputs=drafters)


def publish(run: dict, out: Path, name: str, plot, section, markdown: str | None) -> None:
    """Record how the run was made, then write its files (and the markdown section, when asked)."""
    from dspark.bench.report import publish_run

    run["command"] = command_line()
    written = publish_run(run, out, name, plot, section, Path(markdown) if markdown else None)
    print(f"dspark: wrote {', '.join(str(p) for p in written)}", file=sys.stderr)
