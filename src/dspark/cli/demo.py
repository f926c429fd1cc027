"""`dspark demo`: plain and DSpark decoding side by side on evaluation prompts."""

from __future__ import annotations

from dspark.cli.args import (
    add_compile_arg,
    add_suffix_arg,
    add_target_args,
    check_drafter_arg,
    check_given_files,
    load_target,
    positive_int,
    why_outputs_differ,
)
from dspark.errors import DSparkError


def register(sub) -> None:
    p = sub.add_parser("demo", help="plain vs DSpark side by side with the shipped drafter")
    add_target_args(p)
    add_compile_arg(p)
    p.add_argument("--drafter", help="drafter checkpoint (default: the one shipped for --model)")
    p.add_argument("--datasets", nargs="+", default=["humaneval", "gsm8k", "mt-bench"])
    p.add_argument("--per-set", type=positive_int, default=1)
    p.add_argument("--max-new-tokens", type=positive_int, default=128)
    p.add_argument("--fixed", action="store_true", help="verify all γ draft tokens every round (no scheduler)")
    add_suffix_arg(p)
    p.add_argument(
        "--cost-table",
        help="cost table JSON (`dspark profile`) for the scheduler instead of this machine's (profiled once, cached)",
    )
    p.set_defaults(func=run)


def run(args) -> int:
    import textwrap

    from dspark.assets import eval_path, shipped_drafter
    from dspark.bench.demo import run_demo
    from dspark.decoding.policy import FixedLength
    from dspark.drafter import load_proposer, model_drafter
    from dspark.drafter.hybrid import attune
    from dspark.scheduling.planner import build_scheduler

    if args.fixed and args.cost_table:
        raise DSparkError("--cost-table is for the scheduler and --fixed turns it off; pass one of them")
    drafter_path = args.drafter or shipped_drafter(args.model)
    check_drafter_arg(drafter_path)
    check_given_files(args, ("cost_table",))
    for name in args.datasets:  # an unknown evaluation set is refused before the model loads
        eval_path(name)
    target = load_target(args)
    drafter = load_proposer(drafter_path, target, args.suffix)
    policy = FixedLength()
    if drafter.confidence_head is not None and not args.fixed:
        policy = build_scheduler(target, drafter_path, args.cost_table, drafter=model_drafter(drafter))
        attune(drafter, policy)
    suffix = ", with suffix decoding" if drafter is not model_drafter(drafter) else ""
    print(
        f"target {args.model} ({args.dtype}), drafter {drafter_path}{suffix}, greedy, γ={drafter.block_size}, "
        f"verification: {policy.describe()}, max {args.max_new_tokens} new tokens\n"
    )
    rows = run_demo(target, drafter, args.datasets, args.per_set, args.max_new_tokens, policy)
    why = why_outputs_differ(target)
    for r in rows:
        same = "IDENTICAL" if r.identical else f"DIFFER from token {r.same_prefix + 1} on{why}"
        print(f"=== {r.dataset}: {textwrap.shorten(r.prompt, 100)}")
        print(
            f"--- DSpark (τ={r.tau:.2f}, {r.spec_tokens_per_s:.1f} tok/s) vs plain ({r.plain_tokens_per_s:.1f} tok/s): "
            f"speed-up {r.speedup:.2f}x, outputs {same}"
        )
        print(r.spec_text.strip())
        if not r.identical:
            print("--- plain decoding gave:")
            print(r.plain_text.strip())
        print()
    total_plain = sum(1 / r.plain_tokens_per_s for r in rows)
    total_spec = sum(1 / r.spec_tokens_per_s for r in rows)
    print(
        f"mean τ {sum(r.tau for r in rows) / len(rows):.2f}; speed-up {total_plain / total_spec:.2f}x "
        f"(harmonic over prompts); identical outputs: {sum(r.identical for r in rows)}/{len(rows)}"
    )
    return 0 if all(r.identical for r in rows) or not target.decoder.batch_invariant else 1
