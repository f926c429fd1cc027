"""`dspark bench quality`: how close each precision (and llama.cpp's GGUF) stays to the float32 model."""

from __future__ import annotations

import sys

from dspark.cli.args import positive_int, setup_torch, threads
from dspark.cli.bench import add_output_args, check_bench_args, publish
from dspark.models import DEFAULT_TARGET
from dspark.target import PRECISIONS


def register(sub) -> None:
    p = sub.add_parser(
        "quality",
        help="closeness of each precision and of llama.cpp's GGUF to the float32 model: top-1 agreement, KL, "
        "perplexity, identical greedy answers",
    )
    p.add_argument("--model", default=DEFAULT_TARGET)
    p.add_argument("--threads", type=threads, default=0)
    p.add_argument(
        "--dtypes",
        nargs="+",
        default=list(PRECISIONS),
        choices=PRECISIONS,
        help="precisions of our target to compare with float32 (int8 / int4: weight-only, bfloat16 activations)",
    )
    p.add_argument(
        "--no-llama-cpp",
        dest="llama_cpp",
        action="store_false",
        help="leave out llama.cpp on the package's GGUF (measured when llama-cpp-python is installed)",
    )
    p.add_argument("--name", default="quality", help="name of the result files and of the BENCHMARKS.md section")
    p.add_argument("--datasets", nargs="+", default=["gsm8k", "math500", "humaneval", "mbpp", "mt-bench"])
    p.add_argument("--prompts-per-set", type=positive_int, default=4)
    p.add_argument("--max-new-tokens", type=positive_int, default=128)
    add_output_args(p)
    p.set_defaults(func=run)


def run(args) -> int:
    from dspark.bench.quality import run_quality_bench
    from dspark.bench.report import quality_plot, quality_section

    out = check_bench_args(args, [])
    setup_torch(args)
    run = run_quality_bench(
        args.model,
        args.dtypes,
        args.datasets,
        args.prompts_per_set,
        args.max_new_tokens,
        llama_cpp=args.llama_cpp,
        progress=lambda line: print(line, file=sys.stderr),
    )
    publish(
        run,
        out,
        args.name,
        lambda: quality_plot(run, out / f"{args.name}.png"),
        lambda run_, command, plot: quality_section(run_, command, plot, args.name),
        args.markdown,
    )
    return 0
