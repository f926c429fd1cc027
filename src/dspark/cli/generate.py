"""`dspark generate`: answer one prompt, plain or speculative, streamed or as JSON."""

from __future__ import annotations

import json
import sys

from dspark.cli.args import (
    add_compile_arg,
    add_policy_args,
    add_sampling_args,
    add_suffix_arg,
    add_target_args,
    check_policy_args,
    load_target,
    positive_int,
    sampling_from,
    speculative_engine,
    why_outputs_differ,
)
from dspark.errors import DSparkError


def register(sub) -> None:
    p = sub.add_parser("generate", help="answer one chat prompt, streaming text, plain or speculative")
    p.add_argument("prompt")
    add_target_args(p)
    add_compile_arg(p)
    add_sampling_args(p)
    p.add_argument("--max-new-tokens", type=positive_int, default=256)
    p.add_argument(
        "--drafter", help="drafter checkpoint folder (or ngram:DATA, the n-gram floor): decode speculatively"
    )
    add_policy_args(p)
    add_suffix_arg(p)
    p.add_argument("--compare-plain", action="store_true", help="also run plain decoding; report speed-up and identity")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    p.set_defaults(func=run)


def run(args) -> int:
    from dspark.bench.run import common_prefix
    from dspark.chat import check_text
    from dspark.decoding.plain import generate_plain

    if not check_text(args.prompt).strip():
        raise DSparkError("the prompt is empty; give the model something to answer")
    if args.compare_plain and not args.drafter:
        raise DSparkError("--compare-plain compares speculative decoding with plain decoding; add --drafter PATH")
    check_policy_args(args)
    sampling = sampling_from(args)
    target = load_target(args)
    prompt = target.encode_chat(args.prompt)
    stream = None if args.json else TextStream(target.tokenizer)

    engine = None
    if args.drafter:
        engine = speculative_engine(args, target)
        result = engine.generate([prompt], args.max_new_tokens, sampling, on_tokens=stream)[0]
    else:
        result = generate_plain(target, [prompt], args.max_new_tokens, sampling, on_tokens=stream)[0]

    report = {
        "text": target.tokenizer.decode(result.token_ids, skip_special_tokens=True),
        "token_ids": result.token_ids,
        "new_tokens": len(result.token_ids),
        "finish_reason": result.finish_reason,
        "seconds": round(result.seconds, 4),
        "tokens_per_s": round(result.tokens_per_s, 3),
        "dtype": args.dtype,
    }
    if result.stats is not None:
        s = result.stats.to_dict()
        report.update(tau=s["tau"], accept_by_position=s["accept_by_position"], rounds=s["rounds"], spec_stats=s)
        sources = getattr(engine.drafter if engine else None, "rows_by_source", None)
        if sources is not None:  # the hybrid: rounds drafted by each source
            report["drafted_rounds_by_source"] = dict(sources)
    if args.compare_plain:
        plain = generate_plain(target, [prompt], args.max_new_tokens, sampling)[0]
        report.update(
            plain_tokens_per_s=round(plain.tokens_per_s, 3),
            speedup=round(result.tokens_per_s / plain.tokens_per_s, 3) if plain.tokens_per_s else None,
            identical_to_plain=plain.token_ids == result.token_ids,
            first_difference=None
            if plain.token_ids == result.token_ids
            else common_prefix(plain.token_ids, result.token_ids),
        )
    if args.json:
        print(json.dumps(report, ensure_ascii=False))
        return 0
    print()
    line = f"[{report['new_tokens']} tokens, {report['seconds']:.2f} s, {report['tokens_per_s']:.1f} tokens/s"
    if "tau" in report:
        line += f", τ={report['tau']:.2f} over {report['rounds']} rounds"
    if "speedup" in report:
        line += f"; plain {report['plain_tokens_per_s']:.1f} tokens/s, speed-up {report['speedup']:.2f}x, "
        line += (
            "identical output"
            if report["identical_to_plain"]
            else (
                f"OUTPUT DIFFERS from plain decoding from token {report['first_difference'] + 1} on"
                f"{why_outputs_differ(target, sampling)}"
            )
        )
    print(line + "]", file=sys.stderr)
    return 0


class TextStream:
    """Prints a growing token sequence as text, decoding the whole sequence so multi-byte characters come out whole."""

    def __init__(self, tokenizer, out=sys.stdout):
        self.tokenizer, self.out, self.tokens, self.shown = tokenizer, out, [], ""

    def __call__(self, _request: int, tokens: list[int]) -> None:
        self.tokens.extend(tokens)
        text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        if text.startswith(self.shown) and not text.endswith("\ufffd"):
            self.out.write(text[len(self.shown) :])
            self.out.flush()
            self.shown = text
