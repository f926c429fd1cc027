"""`dspark bench quality`: how close each precision's model stays to the float32 model.

Speculative decoding is lossless against the target it runs on, so the precision decides what users get. The
float32 model answers the evaluation prompts greedily; on those answers, for each precision of our target and for
llama.cpp on the GGUF the model package ships: how often its most likely next token is float32's (top-1
agreement), KL(float32 ‖ it) per token, and the perplexity of the answers; then its own greedy answers to the same
prompts: how many are float32's token for token, and how many tokens they share before the first difference. int4
is read twice: with its bfloat16 LM head, and with the rescored 4-bit head a compiled target runs (`--compile`; its
layers' last bits aside). The evaluation files hold prompts without reference answers, so closeness to float32
stands in for accuracy.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from dspark.assets import eval_prompts
from dspark.bench.run import common_prefix
from dspark.decoding.plain import generate_plain
from dspark.target import Target, load_precision

COMPILED_HEAD = "int4, compiled head"


@torch.no_grad()
def answer_logprobs(target: Target, prompt: list[int], answer: list[int]) -> torch.Tensor:
    """Log-probabilities [len(answer), V] the target gives each answer position, teacher-forced."""
    ids = torch.tensor([prompt + answer], device=target.device)
    logits = target.forward_sequences(ids).logits[0, len(prompt) - 1 : -1]
    return torch.log_softmax(logits.float(), dim=-1).cpu()


def llama_answer_logprobs(llm, prompt: list[int], answer: list[int]) -> torch.Tensor:
    """The same from llama.cpp (a Llama built with logits_all)."""
    llm.reset()
    llm.eval(prompt + answer)
    logits = torch.from_numpy(llm.scores[len(prompt) - 1 : len(prompt) + len(answer) - 1].copy())
    return torch.log_softmax(logits.float(), dim=-1)


def llama_greedy(llm, prompt: list[int], max_new_tokens: int, stop: set[int]) -> list[int]:
    out = []
    for token in llm.generate(prompt, top_k=1, temp=0.0, reset=True):
        if token in stop:
            break
        out.append(token)
        if len(out) == max_new_tokens:
            break
    return out


def closeness(reference: torch.Tensor, logprobs: torch.Tensor, answer: list[int]) -> dict:
    """Sums over one answer: top-1 agreements, KL(reference ‖ logprobs) and negative log-likelihood (nats)."""
    tokens = torch.tensor(answer, dtype=torch.long)[:, None]
    vocab = min(reference.shape[-1], logprobs.shape[-1])  # a GGUF may pad its vocabulary
    reference, logprobs = reference[:, :vocab], logprobs[:, :vocab]
    return {
        "tokens": len(answer),
        "agree": int((logprobs.argmax(-1) == reference.argmax(-1)).sum()),
        "kl": float((reference.exp() * (reference - logprobs)).sum()),
        "nll": float(-logprobs.gather(1, tokens).sum()),
    }


def summary(label: str, dataset: str, sums: list[dict], greedy: list[tuple[list[int], list[int]]]) -> dict:
    """One row of the report: per-token means over the teacher-forced answers, and the free-running comparison."""
    tokens = sum(s["tokens"] for s in sums)
    per_token = max(tokens, 1)  # answers that end at once carry no tokens
    return {
        "precision": label,
        "dataset": dataset,
        "tokens": tokens,
        "top1_agreement": round(sum(s["agree"] for s in sums) / per_token, 4),
        "kl": round(sum(s["kl"] for s in sums) / per_token, 5),
        "perplexity": round(math.exp(sum(s["nll"] for s in sums) / per_token), 3),
        "identical": sum(ours == ref for ours, ref in greedy),
        "prompts": len(greedy),
        "shared_prefix": round(sum(common_prefix(ours, ref) for ours, ref in greedy) / len(greedy), 1),
    }


def run_quality_bench(
    model: str,
    precisions,
    datasets,
    prompts_per_set: int,
    max_new_tokens: int,
    llama_cpp: bool = True,
    progress=print,
) -> dict:
    from dspark.autotune import tune
    from dspark.bench.engine import llama_cpp_model

    exact = tune(load_precision(model, "float32"))  # each precision in the product forms users run it in
    stop = exact.stop_token_ids
    prompts = {name: [exact.encode_chat(p) for p in eval_prompts(name, prompts_per_set)] for name in datasets}

    def answer_all(target: Target) -> dict[str, list[list[int]]]:
        """Greedy answers to every prompt, decoded as one batch (a batch-invariant precision answers as alone)."""
        flat = [
            r.token_ids for r in generate_plain(target, [p for ids in prompts.values() for p in ids], max_new_tokens)
        ]
        return {name: [flat.pop(0) for _ in prompts[name]] for name in datasets}

    answers = answer_all(exact)
    reference = {
        name: [answer_logprobs(exact, p, a) for p, a in zip(prompts[name], answers[name])] for name in datasets
    }
    del exact
    progress(f"float32 answers: {sum(len(a) for v in answers.values() for a in v)} tokens")
    rows = []

    def measure(label: str, logprobs, greedy) -> None:
        """logprobs(set, i): teacher-forced on answer i of the set; greedy: the label's own answers, by set."""
        for name in datasets:
            sums = [
                closeness(ref, logprobs(name, i), a) for i, (a, ref) in enumerate(zip(answers[name], reference[name]))
            ]
            rows.append(summary(label, name, sums, list(zip(greedy[name], answers[name]))))
            progress(str(rows[-1]))

    # float32 against itself first: the perplexity the others are read against
    measure("float32", lambda name, i: reference[name][i], answers)
    for precision in [p for p in precisions if p != "float32"]:
        target = tune(load_precision(model, precision))
        # int4 also with the LM head a compiled target decodes through (its layers as eager's)
        for label in [precision, COMPILED_HEAD] if precision == "int4" else [precision]:
            if label == COMPILED_HEAD:
                target.head.use_rescored()
            measure(
                label, lambda name, i: answer_logprobs(target, prompts[name][i], answers[name][i]), answer_all(target)
            )
    run = {"model": model, "prompts_per_set": prompts_per_set, "max_new_tokens": max_new_tokens, "rows": rows}
    llm = llama_cpp_model(model, torch.get_num_threads(), logits_all=True) if llama_cpp else None
    run["llama_cpp"] = None
    if llm is not None:
        from dspark.llamacpp import require_llama_cpp

        file = Path(llm.model_path)
        # A known target's float weights are read from this very file (dequantized): llama.cpp then runs the
        # float32 model's weights with arithmetic of its own.
        run["llama_cpp"] = {"version": require_llama_cpp().__version__, "file": file.name, "same_weights": True}
        measure(
            f"llama.cpp {file.stem.rsplit('.', 1)[-1]}",
            lambda name, i: llama_answer_logprobs(llm, prompts[name][i], answers[name][i]),
            {name: [llama_greedy(llm, p, max_new_tokens, stop) for p in ids] for name, ids in prompts.items()},
        )
    return run


def overall(run: dict) -> list[dict]:
    """Each precision over every set: token-weighted means, prompts counted."""
    out = []
    for label in dict.fromkeys(r["precision"] for r in run["rows"]):
        rows = [r for r in run["rows"] if r["precision"] == label]
        tokens = sum(r["tokens"] for r in rows)

        def mean(key: str, rows=rows, tokens=tokens) -> float:
            return sum(r[key] * r["tokens"] for r in rows) / tokens

        prompts = sum(r["prompts"] for r in rows)
        out.append(
            {
                "precision": label,
                "tokens": tokens,
                "top1_agreement": round(mean("top1_agreement"), 4),
                "kl": round(mean("kl"), 5),
                "perplexity": round(math.exp(sum(math.log(r["perplexity"]) * r["tokens"] for r in rows) / tokens), 3),
                "identical": sum(r["identical"] for r in rows),
                "prompts": prompts,
                "shared_prefix": round(sum(r["shared_prefix"] * r["prompts"] for r in rows) / prompts, 1),
            }
        )
    return out
