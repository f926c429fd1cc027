"""`dspark bench serve`: the server under load, per verification policy."""

from __future__ import annotations

import sys

from dspark.cli.args import add_target_args, load_target, positive_int
from dspark.cli.bench import add_output_args, check_bench_args, publish


def register(sub) -> None:
    p = sub.add_parser("serve", help="the server under load: latency and throughput per verification policy")
    add_target_args(p)
    p.add_argument("--drafter", help="drafter for the speculative policies (default: the shipped one)")
    p.add_argument("--concurrency", type=positive_int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    p.add_argument(
        "--requests-per-level",
        type=positive_int,
        default=8,
        help="requests per concurrency level at least (each client sends its share back to back)",
    )
    p.add_argument("--max-tokens", type=positive_int, default=32)
    p.add_argument("--datasets", nargs="+", default=["mt-bench", "gsm8k", "humaneval"])
    p.add_argument("--prompts-per-set", type=positive_int, default=8)
    add_output_args(p)
    p.set_defaults(func=run)


def run(args) -> int:
    from dspark.assets import eval_prompts, shipped_drafter
    from dspark.bench.report import serve_plot, serve_section
    from dspark.bench.serve import run_serve_bench
    from dspark.drafter import load_drafter

    drafter_path = args.drafter or shipped_drafter(args.model)
    out = check_bench_args(args, [drafter_path])
    prompts = [p for name in args.datasets for p in eval_prompts(name, args.prompts_per_set)]
    target = load_target(args)
    drafter = load_drafter(drafter_path, target)
    rows = run_serve_bench(
        target,
        drafter,
        drafter_path,
        prompts,
        args.concurrency,
        args.max_tokens,
        args.requests_per_level,
        progress=lambda line: print(line, file=sys.stderr),
    )
    run = {
        "rows": rows,
        "model": args.model,
        "dtype": args.dtype,
        "drafter": str(drafter_path),
        "datasets": args.datasets,
        "max_tokens": args.max_tokens,
        "requests_per_level": args.requests_per_level,
    }
    publish(run, out, "serve", lambda: serve_plot(rows, out / "serve-pareto.png"), serve_section, args.markdown)
    return 0
