"""`dspark regenerate`: the target answers every prompt."""

from __future__ import annotations

import json
from pathlib import Path

from dspark.cli.args import (
    add_sampling_args,
    add_target_args,
    finite_float,
    gguf_arg,
    load_target,
    nonnegative_int,
    positive_int,
    sampling_from,
    setup_torch,
)
from dspark.fsutil import check_output_file


def register(sub) -> None:
    p = sub.add_parser("regenerate", help="have the target answer every prompt (resumable JSONL)")
    p.add_argument("--prompts", required=True, help="messages JSONL, turns JSONL or .txt prompts")
    p.add_argument("--out", required=True, help="JSONL to append to; a rerun continues where it stopped")
    add_target_args(p)
    add_sampling_args(p)
    p.add_argument("--max-new-tokens", type=positive_int, default=384)
    p.add_argument("--batch-size", type=positive_int, default=32)
    p.add_argument("--limit", type=nonnegative_int, default=0, help="only the first N records (0 = all)")
    p.add_argument(
        "--backend",
        choices=["dspark", "llama-cpp"],
        default="dspark",
        help="who answers: our engine (batched) or llama.cpp on the target's GGUF (one sequence per "
        "process, faster per core; needs llama-cpp-python)",
    )
    p.add_argument("--gguf", help="--backend llama-cpp: the target's GGUF (default: the known target's own file)")
    p.add_argument(
        "--device", default="cpu", help="cpu, auto or cuda:N: answer on a GPU (where --dtype auto means bfloat16)"
    )
    p.add_argument(
        "--max-minutes",
        type=finite_float,
        default=0.0,
        help="start no new conversation after this many minutes (0 = no limit); those under way are "
        "finished and written, and a rerun continues with the rest",
    )
    p.set_defaults(func=run)


def run(args) -> int:
    from dspark.records import read_records
    from dspark.target import load_precision, resolve_device
    from dspark.training.regenerate import completed_ids, regenerate

    prompts, out = Path(args.prompts), check_output_file(args.out, "--out", inputs=[args.prompts])
    records = read_records(prompts)
    if args.limit:
        records = records[: args.limit]
    # An --out that is not regenerate output, or was answered in another precision, is refused before the target loads
    completed_ids(out, precision=None if args.dtype == "auto" else args.dtype)
    device = resolve_device(args.device)
    if device.type == "cpu":
        target = load_target(args)
    else:  # auto precision was measured for CPUs; a GPU answers in bfloat16
        setup_torch(args)
        target = load_precision(args.model, "bfloat16" if args.dtype == "auto" else args.dtype, device=device)
    llm = None
    if args.backend == "llama-cpp":
        import torch

        from dspark.training.llama_backend import load_llama

        llm = load_llama(gguf_arg(args.gguf, args.model), target, torch.get_num_threads())
    report = regenerate(
        target,
        records,
        out,
        args.max_new_tokens,
        args.batch_size,
        sampling_from(args),
        llm=llm,
        max_seconds=60 * args.max_minutes,
    )
    print(json.dumps(report))
    return 0
