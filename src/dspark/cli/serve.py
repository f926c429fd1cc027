"""`dspark serve`: the OpenAI-compatible HTTP server."""

from __future__ import annotations

import sys

from dspark.cli.args import (
    add_policy_args,
    add_suffix_arg,
    add_target_args,
    check_policy_args,
    keep_a_core_for_serving,
    load_target,
    nonnegative_float,
    port_number,
    positive_int,
    speculative_engine,
)


def register(sub) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server (continuous batching, plain or speculative)")
    add_target_args(p)
    p.add_argument("--drafter", help="drafter checkpoint: decode speculatively (default: plain decoding)")
    add_policy_args(p)
    add_suffix_arg(p)
    p.add_argument(
        "--isolate-requests",
        action="store_true",
        help="suffix decoding: served answers never join the shared tree, so one client's text cannot speed up (and "
        "so, by timing, reveal itself to) another's",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: this machine only)")
    p.add_argument("--port", type=port_number, default=8000)
    p.add_argument("--api-key", help="require 'Authorization: Bearer KEY' (default: $DSPARK_API_KEY, else none)")
    p.add_argument("--served-model-name", help="the model name clients ask for (default: --model)")
    p.add_argument("--max-batch", type=positive_int, default=32, help="requests decoding together")
    p.add_argument(
        "--max-concurrent", type=positive_int, default=64, help="requests admitted or waiting; more are answered 429"
    )
    p.add_argument("--max-tokens-limit", type=positive_int, default=2048, help="largest max_tokens a request may ask")
    p.add_argument("--max-body-bytes", type=positive_int, default=1 << 20, help="largest request body (413 above)")
    p.add_argument(
        "--drain-seconds",
        type=nonnegative_float,
        default=10.0,
        help="on SIGINT/SIGTERM, requests in flight get this long to finish before they are ended",
    )
    p.set_defaults(func=run)


def run(args) -> int:
    import os

    from dspark.decoding.engine import SpeculativeEngine
    from dspark.scheduling.profile import batch_sizes_up_to
    from dspark.serve.app import ServeConfig, create_app
    from dspark.serve.local import DrainingServer, server_config

    check_policy_args(args)
    config = ServeConfig(
        model_name=args.served_model_name or args.model,
        api_key=args.api_key or os.environ.get("DSPARK_API_KEY") or None,
        max_batch=args.max_batch,
        max_concurrent=args.max_concurrent,
        max_tokens_limit=args.max_tokens_limit,
        max_body_bytes=args.max_body_bytes,
        drain_seconds=args.drain_seconds,
    )
    keep_a_core_for_serving(args)
    target = load_target(args)
    # The scheduler plans with the cost of the batch shapes this server runs: rows up to --max-batch.
    shapes = batch_sizes_up_to(args.max_batch)
    engine = speculative_engine(args, target, shapes) if args.drafter else SpeculativeEngine(target)
    drafter = engine.drafter
    if args.host not in ("127.0.0.1", "localhost", "::1"):
        print(
            f"dspark: serving on {args.host}, reachable from other machines"
            f"{'' if config.api_key else ' WITHOUT an API key (--api-key or DSPARK_API_KEY)'}",
            file=sys.stderr,
        )
    print(
        f"dspark: serving '{config.model_name}' ({'speculative, ' + engine.policy.describe() if drafter else 'plain'}"
        f" decoding) on http://{args.host}:{args.port}/v1",
        file=sys.stderr,
    )
    app = create_app(engine, target.tokenizer, config)
    DrainingServer(server_config(app, args.host, args.port, config.drain_seconds)).run()
    return 0
