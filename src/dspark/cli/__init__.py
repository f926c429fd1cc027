"""The `dspark` command: one module per subcommand (its parser and its run function), the only code that reads
command-line arguments; each calls the library."""

from __future__ import annotations

import argparse
import logging
import sys

from dspark.errors import DSparkError

# In the order `dspark --help` lists them: the everyday commands, then making a drafter, then measuring.
COMMANDS = (
    "generate",
    "serve",
    "demo",
    "models",
    "autotune",
    "export",
    "import_",
    "prompts",
    "regenerate",
    "train",
    "calibrate",
    "suffix_index",
    "profile",
    "bench",
)
RENAMED = {
    "bench-engine": "bench engine",
    "bench-serve": "bench serve",
    "bench-signal": "bench signal",
    "bench-train": "bench train",
    "bench-llama-cpp": "bench llama-cpp",
    "scaling": "bench scaling",
    "curves": "bench curves",
}


def build_parser() -> argparse.ArgumentParser:
    from importlib import import_module

    import dspark

    parser = argparse.ArgumentParser(prog="dspark", description=dspark.__doc__)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMANDS:
        import_module(f"dspark.cli.{name}").register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in RENAMED:
        print(f"dspark: error: `dspark {argv[0]}` is now `dspark {RENAMED[argv[0]]}`", file=sys.stderr)
        return 2
    args = build_parser().parse_args(argv)
    logging.basicConfig(format="dspark: %(message)s", level=logging.INFO, stream=sys.stderr)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # the benchmarks' clients: no line per request
    try:
        return args.func(args)
    except DSparkError as e:
        print(f"dspark: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("dspark: interrupted", file=sys.stderr)
        return 130
