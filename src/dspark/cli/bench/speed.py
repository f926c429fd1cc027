"""`dspark bench speed`: τ, speed and agreement of every method, side by side."""

from __future__ import annotations

import sys

from dspark.cli.args import finite_float, parse_labelled, positive_int, setup_torch, threads
from dspark.cli.bench import add_output_args, check_bench_args, publish
from dspark.models import DEFAULT_TARGET


def register(sub) -> None:
    p = sub.add_parser("speed", help="τ, speed, agreement and memory of every method, side by side")
    p.add_argument("--model", default=DEFAULT_TARGET)
    p.add_argument("--threads", type=threads, default=0)
    p.add_argument(
        "--datasets",
        nargs="+",
        default=["humaneval", "gsm8k", "mt-bench", "mbpp", "math500"],
        help='evaluation set names or JSONL paths of {"turns": [...]} records',
    )
    p.add_argument("--prompts-per-set", type=positive_int, default=3)
    p.add_argument("--max-new-tokens", type=positive_int, default=128)
    p.add_argument("--temperatures", type=finite_float, nargs="+", default=[0.0, 1.0])
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    p.add_argument(
        "--drafter",
        action="append",
        help="LABEL=PATH, repeatable (default: dspark=<shipped drafter>, beside suffix decoding where it ships an "
        "answer index); PATH as for generate: a checkpoint, no-suffix:CHECKPOINT (the drafter alone), "
        "suffix:CHECKPOINT (suffix decoding alone, its tree filled from that drafter's answers), ngram:DATA",
    )
    p.add_argument("--peers", nargs="*", default=["hf", "hf-lookup"], choices=["hf", "hf-lookup"])
    p.add_argument(
        "--scheduled",
        action="store_true",
        help="also run drafters that have a confidence head under the prefix scheduler (LABEL+sched)",
    )
    p.add_argument(
        "--second-turns",
        action="store_true",
        help="ask each record's second turn after our plain decoding's answer to its first (MT-Bench: rewrites of "
        "that answer, text that repeats); records with one turn are left out",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--name", default="quick", help="name of the result files and of the BENCHMARKS.md section")
    add_output_args(p)
    p.set_defaults(func=run)


def run(args) -> int:
    from dspark.assets import shipped_drafter
    from dspark.bench.report import markdown_section, plots
    from dspark.bench.run import BenchConfig, run_bench

    drafters = parse_labelled(
        args.drafter or [f"dspark={shipped_drafter(args.model)}"], "--drafter", "dspark=runs/drafter/checkpoint"
    )
    out = check_bench_args(args, drafters.values())
    if args.second_turns:  # a set without second turns is refused before the model loads
        from dspark.assets import eval_conversations

        for name in args.datasets:
            eval_conversations(name, 1)
    setup_torch(args)
    cfg = BenchConfig(
        model=args.model,
        datasets=args.datasets,
        prompts_per_set=args.prompts_per_set,
        max_new_tokens=args.max_new_tokens,
        temperatures=args.temperatures,
        dtypes=args.dtypes,
        drafters=drafters,
        peers=args.peers,
        seed=args.seed,
        scheduled=args.scheduled,
        second_turns=args.second_turns,
    )
    run = run_bench(cfg, progress=lambda line: print(line, file=sys.stderr))
    publish(
        run,
        out,
        args.name,
        lambda: plots(run, out, args.name),
        lambda run_, command, rel: markdown_section(run_, args.name, command, rel),
        args.markdown,
    )
    return 0
