"""`dspark bench clients`: guidellm and lm-evaluation-harness, unchanged, against the plain and the speculative
server."""

from __future__ import annotations

import sys

from dspark.cli.args import (
    add_policy_args,
    add_suffix_arg,
    add_target_args,
    check_policy_args,
    keep_a_core_for_serving,
    load_target,
    positive_int,
)
from dspark.cli.bench import add_output_args, check_bench_args, publish
from dspark.errors import DSparkError


def register(sub) -> None:
    p = sub.add_parser(
        "clients",
        help="third-party clients against dspark serve, plain and speculative: guidellm's streamed load and "
        "lm-eval's completions (batched) and chat completions, with the two servers' texts compared",
    )
    add_target_args(p)
    p.add_argument(
        "--drafter", help="the speculative server's drafter (default: the shipped one, beside suffix decoding)"
    )
    add_policy_args(p)
    add_suffix_arg(p)
    p.add_argument("--streams", type=positive_int, nargs="+", default=[1, 4, 16], help="guidellm's concurrent streams")
    p.add_argument("--requests-per-stream", type=positive_int, default=2, help="guidellm requests per stream a level")
    p.add_argument("--prompt-tokens", type=positive_int, default=128, help="guidellm's synthetic prompt length")
    p.add_argument("--max-tokens", type=positive_int, default=128, help="new tokens per request")
    p.add_argument("--dataset", default="gsm8k", help="the evaluation set lm-eval's task reads its prompts from")
    p.add_argument("--lm-eval-limit", type=positive_int, default=16, help="prompts lm-eval sends")
    p.add_argument("--lm-eval-batch", type=positive_int, default=4, help="prompts per local-completions request")
    p.add_argument("--name", default="clients", help="name of the result files and of the BENCHMARKS.md section")
    add_output_args(p)
    p.set_defaults(func=run)


def run(args) -> int:
    from dspark import models
    from dspark.assets import eval_path, shipped_drafter
    from dspark.bench.clients import clients_section, missing_clients, run_clients_bench
    from dspark.cli.args import speculative_engine
    from dspark.decoding.engine import SpeculativeEngine
    from dspark.scheduling.profile import batch_sizes_up_to

    missing = missing_clients()
    if missing:
        raise DSparkError(f"{' and '.join(missing)} not installed; pip install 'dspark[clients]' (or make clients)")
    described = args.drafter or f"the shipped drafter of {args.model}"
    args.drafter = args.drafter or str(shipped_drafter(args.model))
    if args.verify_length is None and args.confidence_threshold is None:
        args.schedule = True  # the speculative server as `dspark serve --schedule` runs it, unless told otherwise
    check_policy_args(args)
    out = check_bench_args(args, [args.drafter])
    keep_a_core_for_serving(args)
    target = load_target(args)
    speculative = speculative_engine(args, target, batch_sizes_up_to(max(args.streams)))
    engines = {"plain": SpeculativeEngine(target), "speculative": speculative}
    run = run_clients_bench(
        target,
        engines,
        args.model,
        str(models.resolve(args.model)),
        eval_path(args.dataset),
        out,
        args.streams,
        args.requests_per_stream,
        args.prompt_tokens,
        args.max_tokens,
        args.lm_eval_limit,
        args.lm_eval_batch,
        progress=lambda line: print(line, file=sys.stderr),
    )
    run.update(
        model=args.model,
        dtype=target.precision,
        speculative=f"{described}, {speculative.policy.describe()}",
        prompt_tokens=args.prompt_tokens,
        max_tokens=args.max_tokens,
        dataset=args.dataset,
        lm_eval_limit=args.lm_eval_limit,
    )
    publish(run, out, args.name, lambda: None, clients_section, args.markdown)
    return 0
