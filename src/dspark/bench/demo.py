"""`dspark demo`: the shipped drafter against plain decoding of the same target, side by side, on evaluation prompts."""

from __future__ import annotations

from dataclasses import dataclass

from dspark.assets import eval_prompts
from dspark.bench.run import common_prefix
from dspark.decoding.engine import SpeculativeEngine
from dspark.decoding.plain import generate_plain


@dataclass
class DemoRow:
    dataset: str
    prompt: str
    plain_text: str
    spec_text: str
    identical: bool
    same_prefix: int  # tokens both outputs share before they first differ
    plain_tokens_per_s: float
    spec_tokens_per_s: float
    tau: float

    @property
    def speedup(self) -> float:
        return self.spec_tokens_per_s / self.plain_tokens_per_s if self.plain_tokens_per_s else 0.0


def run_demo(target, drafter, datasets=("humaneval", "gsm8k", "mt-bench"), per_set=1, max_new_tokens=128, policy=None):
    """Each prompt decoded plainly and speculatively (greedy), after one untimed warm-up of both paths."""
    engine = SpeculativeEngine(target, drafter, policy)
    warm = target.encode_chat("Hello!")
    generate_plain(target, [warm], 8)
    engine.generate([warm], 8)
    rows = []
    for name in datasets:
        for prompt in eval_prompts(name, per_set):
            ids = target.encode_chat(prompt)
            plain = generate_plain(target, [ids], max_new_tokens)[0]
            spec = engine.generate([ids], max_new_tokens)[0]
            decode = lambda r: target.tokenizer.decode(r.token_ids, skip_special_tokens=True)
            rows.append(
                DemoRow(
                    name,
                    prompt,
                    decode(plain),
                    decode(spec),
                    plain.token_ids == spec.token_ids,
                    common_prefix(plain.token_ids, spec.token_ids),
                    plain.tokens_per_s,
                    spec.tokens_per_s,
                    spec.stats.tau,
                )
            )
    return rows
