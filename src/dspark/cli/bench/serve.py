"""`dspark bench serve`: the server under load, per verification policy."""

from __future__ import annotations

import sys

from dspark.cli.args import (
    add_suffix_arg,
    add_target_args,
    finite_float,
    keep_a_core_for_serving,
    load_target,
    nonnegative_int,
    positive_int,
)
from dspark.cli.bench import add_output_args, check_bench_args, publish

ALL_SETS = ["gsm8k", "math500", "humaneval", "mbpp", "mt-bench"]


def register(sub) -> None:
    p = sub.add_parser("serve", help="the server under load: latency and throughput per verification policy")
    add_target_args(p)
    p.add_argument(
        "--drafter",
        help="drafter for the speculative policies (default: the shipped one, beside suffix decoding where it ships an "
        "answer index; the trees are isolated, so no level drafts from the answers an earlier one served)",
    )
    add_suffix_arg(p)
    p.add_argument("--concurrency", type=positive_int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    p.add_argument("--min-requests", type=positive_int, default=64, help="a level ends after this many requests ...")
    p.add_argument("--min-tokens", type=positive_int, default=3000, help="... or this many generated tokens")
    p.add_argument("--max-tokens", type=positive_int, default=256, help="new tokens per request at most")
    p.add_argument("--repetitions", type=positive_int, default=3, help="runs of every level (95 %% intervals)")
    p.add_argument(
        "--fixed-lengths", type=nonnegative_int, nargs="+", default=[1, 2, 3, 4, 5, 6, 7], help="fixed ℓ policies"
    )
    p.add_argument(
        "--thresholds", type=finite_float, nargs="*", default=[0.5], help="static threshold policies (none: skip)"
    )
    p.add_argument("--datasets", nargs="+", default=ALL_SETS, help="evaluation sets the prompts are mixed from")
    p.add_argument("--prompts-per-set", type=positive_int, default=16)
    p.add_argument("--name", default="serve", help="name of the result files and of the BENCHMARKS.md section")
    add_output_args(p)
    p.set_defaults(func=run)


def run(args) -> int:
    from dspark.assets import eval_prompts, shipped_drafter
    from dspark.autotune import cached_cost_table
    from dspark.bench.serve import run_serve_bench, summarise
    from dspark.bench.serve_report import serve_plots, serve_section
    from dspark.drafter import load_proposer, model_drafter
    from dspark.scheduling.profile import batch_sizes_up_to

    drafter_path = args.drafter or shipped_drafter(args.model)
    out = check_bench_args(args, [drafter_path])
    # Interleaved, so every stretch of requests mixes the sets.
    by_set = [eval_prompts(name, args.prompts_per_set) for name in args.datasets]
    prompts = [p for group in zip(*by_set) for p in group]
    keep_a_core_for_serving(args)
    target = load_target(args)
    drafter = load_proposer(drafter_path, target, args.suffix, isolate=True)
    rows = run_serve_bench(
        target,
        drafter,
        drafter_path,
        prompts,
        args.concurrency,
        args.max_tokens,
        args.min_requests,
        args.min_tokens,
        args.repetitions,
        out,
        tuple(args.fixed_lengths),
        tuple(args.thresholds),
        progress=lambda line: print(line, file=sys.stderr),
    )
    cost = cached_cost_table(
        target, batch_sizes=batch_sizes_up_to(max(args.concurrency)), drafter=model_drafter(drafter)
    )
    run = {
        "rows": rows,
        "summary": summarise(rows),
        "cost_table": {"grid": cost.meta.get("grid", []), "draft": cost.meta.get("draft", [])},
        "model": args.model,
        "dtype": args.dtype,
        "drafter": str(drafter_path),
        "datasets": args.datasets,
        "max_tokens": args.max_tokens,
        "min_requests": args.min_requests,
        "min_tokens": args.min_tokens,
        "repetitions": args.repetitions,
    }
    publish(
        run,
        out,
        args.name,
        lambda: serve_plots(run, out, args.name),
        lambda run_, command, plots: serve_section(run_, command, plots, args.name),
        args.markdown,
    )
    return 0
