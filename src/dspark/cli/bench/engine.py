"""`dspark bench engine`: forward cost of our engine, Hugging Face and llama.cpp against the bandwidth bound."""

from __future__ import annotations

import sys

from dspark.cli.args import positive_int, setup_torch, threads
from dspark.cli.bench import add_output_args, check_bench_args, publish
from dspark.models import DEFAULT_TARGET
from dspark.target import PRECISIONS


def register(sub) -> None:
    p = sub.add_parser("engine", help="forward cost of our engine vs HF and llama.cpp, against the bandwidth bound")
    p.add_argument("--model", default=DEFAULT_TARGET)
    p.add_argument("--threads", type=threads, default=0)
    p.add_argument(
        "--dtypes",
        nargs="+",
        default=["bfloat16", "float32"],
        choices=PRECISIONS,
        help="int8 / int4: weight-only 8-bit or 4-bit weights with bfloat16 activations",
    )
    p.add_argument("--name", default="engine", help="name of the result files and of the BENCHMARKS.md section")
    p.add_argument("--drafter", help="drafter for the DSpark rows (default: the shipped one)")
    p.add_argument("--datasets", nargs="+", default=["humaneval", "gsm8k", "mt-bench", "mbpp", "math500"])
    p.add_argument("--max-new-tokens", type=positive_int, default=96)
    p.add_argument(
        "--compile",
        action="store_true",
        help="also run int4 through its compiled decode step (`--compile`)",
    )
    add_output_args(p)
    p.set_defaults(func=run)


def run(args) -> int:
    from dspark.assets import shipped_drafter
    from dspark.bench.engine import run_engine_bench
    from dspark.bench.report import engine_plot, engine_section

    drafter = args.drafter or shipped_drafter(args.model)
    out = check_bench_args(args, [drafter])
    setup_torch(args)
    run = run_engine_bench(
        args.model,
        args.dtypes,
        drafter,
        args.datasets,
        args.max_new_tokens,
        progress=lambda line: print(line, file=sys.stderr),
        compiled=args.compile,
    )
    publish(
        run,
        out,
        args.name,
        lambda: engine_plot(run, out / f"{args.name}-forward.png"),
        lambda run_, command, plot: engine_section(run_, command, plot, args.name),
        args.markdown,
    )
    return 0
