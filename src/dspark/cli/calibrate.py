"""`dspark calibrate`: STS temperatures of a drafter's confidence head."""

from __future__ import annotations

import json
import sys

from dspark.cli.args import add_target_args, check_drafter_arg, load_target, positive_int
from dspark.fsutil import check_output_file, is_json_with, is_matplotlib_png


def register(sub) -> None:
    p = sub.add_parser("calibrate", help="fit STS temperatures of a drafter's confidence head on real rounds")
    p.add_argument("--drafter", required=True)
    add_target_args(p)
    p.add_argument("--data", help="held-out prompts (messages/turns JSONL or .txt); default: --datasets")
    p.add_argument("--datasets", nargs="+", default=["mt-bench"], help="evaluation sets to draw prompts from")
    p.add_argument("--limit", type=positive_int, default=20, help="prompts (per dataset)")
    p.add_argument("--max-new-tokens", type=positive_int, default=128)
    p.add_argument("--out", required=True)
    p.add_argument("--plot", help="reliability plot PNG")
    p.set_defaults(func=run)


def run(args) -> int:
    from dspark.assets import eval_prompts
    from dspark.drafter import load_drafter
    from dspark.fsutil import atomic_write_json
    from dspark.records import read_records
    from dspark.scheduling.calibration import collect_rounds, fit_sts, reliability_plot, report

    check_drafter_arg(args.drafter)
    inputs = [args.data] if args.data else []
    check_output_file(args.out, "--out", inputs, ours=lambda p: is_json_with(p, "sts_temperatures"))
    if args.plot:
        check_output_file(args.plot, "--plot", inputs + [args.out], ours=is_matplotlib_png)
    if args.data:
        texts = [next(m["content"] for m in r["messages"] if m["role"] == "user") for r in read_records(args.data)]
        texts = texts[: args.limit]
    else:
        texts = [t for name in args.datasets for t in eval_prompts(name, args.limit)]
    target = load_target(args)
    drafter = load_drafter(args.drafter, target)
    rounds = collect_rounds(target, drafter, [target.encode_chat(t) for t in texts], args.max_new_tokens)
    temps = fit_sts(rounds)
    rows = report(rounds, temps)
    atomic_write_json(
        args.out,
        {
            "sts_temperatures": temps,
            "rounds": len(rounds.logits),
            "report": rows,
            "drafter": str(args.drafter),
            "prompts": len(texts),
            "data": args.data or args.datasets,
            "dtype": args.dtype,
            "max_new_tokens": args.max_new_tokens,
        },
    )
    if args.plot:
        reliability_plot(rounds, temps, args.plot)
    for r in rows:
        print(json.dumps(r))
    print(f"dspark: {len(rounds.logits)} rounds; STS temperatures {temps}; wrote {args.out}", file=sys.stderr)
    return 0
