"""`dspark profile`: this machine's verify cost table."""

from __future__ import annotations

import sys

from dspark.cli.args import add_target_args, load_target, positive_int
from dspark.fsutil import check_output_file, is_json_with


def register(sub) -> None:
    p = sub.add_parser("profile", help="measure the verify cost table SPS(B) of this machine (JSON)")
    add_target_args(p)
    p.add_argument("--out", required=True)
    p.add_argument("--token-counts", type=positive_int, nargs="+", default=[1, 2, 3, 4, 5, 6, 8, 12, 16])
    p.add_argument("--context", type=positive_int, default=256)
    p.add_argument("--repeats", type=positive_int, default=7)
    p.add_argument(
        "--batch-sizes",
        type=positive_int,
        nargs="+",
        default=[1],
        help="rows per forward; the table is indexed by the tokens a forward carries in all",
    )
    p.set_defaults(func=run)


def run(args) -> int:
    from dspark.scheduling.profile import profile_target

    check_output_file(args.out, "--out", ours=lambda p: is_json_with(p, "token_counts", "step_time_ms"))
    target = load_target(args)
    table = profile_target(target, tuple(args.token_counts), args.context, args.repeats, tuple(args.batch_sizes))
    table.save(args.out)
    one = table.meta["grid"][0]["ms"]
    for g in table.meta["grid"]:
        print(
            f"batch {g['batch_size']:>3} x {g['tokens_per_row']:>3} tokens  {g['ms']:8.2f} ms  "
            f"({g['ms'] / one:.2f}x one token)"
        )
    print(f"dspark: wrote {args.out}", file=sys.stderr)
    return 0
