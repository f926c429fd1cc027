"""`dspark suffix-index`: the answers that fill suffix decoding's global tree, shipped beside a drafter."""

from __future__ import annotations

import random
import sys
from pathlib import Path

from dspark.cli.args import positive_int
from dspark.errors import DSparkError


def register(sub) -> None:
    p = sub.add_parser(
        "suffix-index",
        help="write the answers that fill suffix decoding's global tree into a drafter folder (or a file)",
    )
    p.add_argument("--data", nargs="+", required=True, help="regenerated JSONL (or .jsonl.gz) the drafter trained on")
    p.add_argument("--out", required=True, help="a drafter folder (writes its answer index there) or a file path")
    p.add_argument(
        "--count",
        type=positive_int,
        default=1000,
        help="answers kept, drawn at random across the files (~64 MB of tree and ~1 s of load per 1,000)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=run)


def run(args) -> int:
    from dspark.drafter.suffix import ANSWER_INDEX, is_answer_index, write_answer_index
    from dspark.fsutil import check_input_file, check_output_file, read_jsonl

    out = Path(args.out)
    if out.is_dir():
        out = out / ANSWER_INDEX
    for path in args.data:
        check_input_file(path, "--data")
    check_output_file(out, "--out", inputs=args.data, ours=is_answer_index)
    answers = [a for path in args.data for r in read_jsonl(path) for a in r.get("assistant_token_ids") or [] if a]
    if not answers:
        raise DSparkError("--data holds no regenerated answers (assistant_token_ids); give `dspark regenerate` output")
    random.Random(args.seed).shuffle(answers)
    kept = answers[: args.count]
    write_answer_index(kept, out)
    print(f"dspark: wrote {len(kept)} answers ({sum(map(len, kept))} tokens) to {out}", file=sys.stderr)
    return 0
