"""Regeneration by llama.cpp (through llama-cpp-python) on the target's GGUF: the same answers' job as our engine,
at llama.cpp's single-stream speed (docs/design.md §3). One sequence at a time; run one process per core for more.

llama.cpp computes with the GGUF's own (quantized) weights, so its greedy answers can part from the safetensors
target's at near-ties; every record says which backend wrote it."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterator
from pathlib import Path

from dspark.decoding.requests import GenerationResult
from dspark.errors import DSparkError
from dspark.llamacpp import load_gguf, require_llama_cpp
from dspark.sampling import SamplingParams


def load_llama(gguf: Path, target, threads: int):
    """llama.cpp on the target's GGUF, refused unless it has the target's vocabulary."""
    llm = load_gguf(gguf, threads, n_ctx=4096, n_batch=512)
    if llm.n_vocab() != target.vocab_size:
        raise DSparkError(
            f"{gguf} has a vocabulary of {llm.n_vocab()}, the target {target.vocab_size}: pass the GGUF "
            "of the same model"
        )
    return llm


def backend_identity(llm) -> dict:
    return {"name": "llama.cpp", "gguf": Path(llm.model_path).name, "llama_cpp_python": require_llama_cpp().__version__}


def stream_llama(
    llm, queue: deque, max_new_tokens: int, sampling: SamplingParams, stop_token_ids: set[int]
) -> Iterator[tuple[object, GenerationResult]]:
    """Decode (key, prompt_ids) items popped from `queue` one at a time, as `stream_plain` does with our engine."""
    greedy = sampling.temperature == 0
    if sampling.seed is not None:
        llm.set_seed(sampling.seed)
    while queue:
        key, prompt = queue.popleft()
        start, tokens, finish = time.perf_counter(), [], "length"
        if len(prompt) + max_new_tokens > llm.n_ctx():
            raise DSparkError(
                f"a prompt of {len(prompt)} tokens plus {max_new_tokens} new ones exceeds llama.cpp's "
                f"context of {llm.n_ctx()}"
            )
        # Greedy: argmax (temperature 0). Sampling: the SPEC's temperature / top-k / top-p, nothing else.
        for token in llm.generate(
            prompt,
            temp=sampling.temperature,
            top_k=sampling.top_k if not greedy else 1,
            top_p=sampling.top_p,
            min_p=0.0,
            repeat_penalty=1.0,
            reset=True,
        ):
            tokens.append(int(token))
            if token in stop_token_ids:
                finish = "stop"
                break
            if len(tokens) == max_new_tokens:
                break
        yield key, GenerationResult(tokens, finish, time.perf_counter() - start)
