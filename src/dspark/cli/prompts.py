"""`dspark prompts`: the offline training prompt mix."""

from __future__ import annotations

import json

from dspark.cli.args import add_target_args, default_eval_dir, finite_float, load_target, positive_int, prompt_mix
from dspark.errors import DSparkError
from dspark.fsutil import check_output_file, is_json_with, jsonl_lines


def register(sub) -> None:
    p = sub.add_parser("prompts", help="build the offline training prompt mix (chat, math, code, instructions)")
    p.add_argument("--out", required=True, help="prompts JSONL to write")
    p.add_argument("--count", type=positive_int, default=10000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-dir", default=str(default_eval_dir()), help="evaluation sets that prompts must not overlap")
    p.add_argument(
        "--mix",
        type=prompt_mix,
        help="shares per source, e.g. assist=1 or chat=0.18,math=0.39,code=0.39,"
        "instruct=0.04 (default: chat 0.08, assist 0.10, math 0.39, code "
        "0.39, instruct 0.04); library: tasks from numpy, networkx and sympy; self: requests the target "
        "(--model) writes itself from its chat template",
    )
    add_target_args(p)
    p.add_argument(
        "--self-temperature",
        type=finite_float,
        default=1.0,
        help="the self source: sampling temperature of the written requests",
    )
    p.add_argument(
        "--self-max-tokens", type=positive_int, default=128, help="the self source: longest request (longer: dropped)"
    )
    p.add_argument(
        "--exclude",
        nargs="+",
        default=[],
        metavar="JSONL",
        help="drop prompts whose opening user turn one of these files (JSONL or .jsonl.gz: earlier "
        "regenerated sets) already holds, so new regeneration answers only new prompts",
    )
    p.set_defaults(func=run)


def is_prompts_file(path) -> bool:
    """An earlier output of `dspark prompts`: every line a record with its id, source and messages."""
    try:
        records = [json.loads(line) for _, line in jsonl_lines(path)]
    except (DSparkError, ValueError):
        return False
    return all(isinstance(r, dict) and {"id", "source", "messages"} <= r.keys() for r in records)


def run(args) -> int:
    from dspark.fsutil import atomic_write_json, atomic_write_text
    from dspark.training.sources import build_prompts, drop_answered

    inputs = [args.eval_dir, *args.exclude]
    check_output_file(args.out, "--out", inputs, ours=is_prompts_file)
    report_path = check_output_file(
        f"{args.out}.report.json", "--out's report", inputs, ours=lambda p: is_json_with(p, "requested", "counts")
    )
    write_self = None
    if (args.mix or {}).get("self"):
        from dspark.training.self_prompts import write_user_turns

        target = load_target(args)

        def write_self(count, seed, forbidden):
            return write_user_turns(target, count, seed, forbidden, args.self_temperature, args.self_max_tokens)

    records, report = build_prompts(args.count, args.seed, args.eval_dir, args.mix, write_self)
    if args.exclude:
        kept = drop_answered(records, args.exclude)
        report["excluded_already_answered"] = len(records) - len(kept)
        records = kept
    atomic_write_text(args.out, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
    atomic_write_json(report_path, report)
    print(json.dumps(report))
    return 0
