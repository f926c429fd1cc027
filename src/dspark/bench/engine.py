"""`dspark bench engine`: what one forward costs, against the machine's physical limit and against other engines.

Side by side in one run, per precision: milliseconds per forward of n = 1..16 new tokens on a cached context for
our decoder, the Hugging Face model it replaces, and llama.cpp running the GGUF file the model package ships (when
llama-cpp-python is installed; that file is 4-bit, so it streams fewer bytes than a 16-bit precision); the
memory-bandwidth bound (weight bytes ÷ the bandwidth a large matrix-vector product reaches here); then plain
decoding tokens/s of each engine and DSpark tokens/s (fixed γ and scheduled) on the evaluation sets, and how many
tokens each precision's plain output shares with float32's before they differ. Precisions: float32, bfloat16, int8
and int4 (weight-only, with bfloat16 activations).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from pathlib import Path

import torch

from dspark.assets import eval_prompts
from dspark.bench.run import common_prefix, hf_generate, warm_dspark_engines
from dspark.decoding.plain import generate_plain
from dspark.sampling import SamplingParams


def median_ms(fn, repeats: int, undo=lambda: None) -> float:
    samples = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
        undo()
    samples = sorted(samples[1:])
    return round(1000 * samples[len(samples) // 2], 2)


def memory_bandwidth_gbs(gib: float = 0.5) -> float:
    """Bytes per second a large float32 matrix-vector product streams (the kind of read a decode step is)."""
    rows = int(gib * 2**30 / 4 / 8192)
    weight, x = torch.randn(rows, 8192), torch.randn(1, 8192)
    ms = median_ms(lambda: torch.nn.functional.linear(x, weight), 5)
    return round(weight.numel() * 4 / (ms / 1000) / 1e9, 1)


def streamed_bytes(target) -> int:
    """Bytes of weights one decode step reads: every matrix and norm of every layer, the final norm and the LM head
    (int8 and int4 matrices at their packed size plus their scales); the embedding lookup reads one row."""
    weights = [getattr(layer, f.name) for layer in target.decoder.layers for f in dataclasses.fields(layer)]
    weights += [target.decoder.final_norm, target.head.form]
    return sum(w.nbytes for w in weights if w is not None)


@torch.no_grad()
def hf_forward_ms(target, context_ids: torch.Tensor, counts, repeats: int) -> dict:
    from transformers import DynamicCache

    cache = DynamicCache()
    target.model(context_ids, cache=cache, use_cache=True)
    out = {}
    for n in counts:
        ids = context_ids[:, :n]
        out[n] = median_ms(
            lambda: target.model(ids, cache=cache, use_cache=True, output_hidden_states=True),
            repeats,
            lambda: cache.crop(-n),
        )
    return out


def llama_cpp_model(model: str, threads: int, logits_all: bool, lookup: bool = False):
    """llama.cpp on the GGUF file of a known target's package, or None (llama-cpp-python not usable, or a target
    that ships no GGUF). logits_all: every evaluated token's logits (a forward's, as ours return them), not only
    the last one's (decoding, as users run it: keeping them all cost its completions 1-11 %). lookup: decoding with
    llama-cpp-python's prompt-lookup speculation."""
    from dspark.llamacpp import import_llama_cpp, load_gguf, prompt_lookup_draft
    from dspark.models import KNOWN_TARGETS, target_gguf

    if import_llama_cpp() is None or model not in KNOWN_TARGETS:
        return None
    draft = {"draft_model": prompt_lookup_draft()} if lookup else {}
    return load_gguf(target_gguf(model), threads, n_ctx=2048, n_batch=512, logits_all=logits_all, **draft)


def llama_forward_ms(llm, context_ids: list[int], counts, repeats: int) -> dict:
    llm.reset()
    llm.eval(context_ids)
    base = llm.n_tokens

    def undo():
        llm._ctx.kv_cache_seq_rm(0, base, -1)
        llm.n_tokens = base

    return {n: median_ms(lambda: llm.eval(context_ids[:n]), repeats, undo) for n in counts}


def llama_generate(llm, prompt_ids: list[int], max_new_tokens: int) -> tuple[str, int, float]:
    """Greedy completion through llama-cpp-python's own loop (it stops at the model's end-of-text token): text,
    tokens and seconds."""
    llm.reset()
    start = time.perf_counter()
    out = llm.create_completion(prompt=prompt_ids, max_tokens=max_new_tokens, temperature=0.0)
    return out["choices"][0]["text"], out["usage"]["completion_tokens"], time.perf_counter() - start


def run_engine_bench(
    model: str,
    dtypes,
    drafter_path,
    datasets,
    max_new_tokens: int,
    counts=(1, 2, 4, 8, 16),
    context: int = 256,
    repeats: int = 7,
    bandwidth_gib: float = 0.5,
    progress=print,
    compiled: bool = False,
) -> dict:
    """compiled: also each precision's target compiled (compile_target), its forward and decoding rows labelled so."""
    from dspark.autotune import tune
    from dspark.compiled import compile_target
    from dspark.scheduling.profile import profile_target
    from dspark.target import Target, load_precision

    threads = torch.get_num_threads()
    run = {"bandwidth_gbs": memory_bandwidth_gbs(bandwidth_gib), "forward": [], "decode": [], "llama_cpp": None}
    progress(f"memory bandwidth {run['bandwidth_gbs']} GB/s")
    llm, llm_decoding = llama_cpp_model(model, threads, True), llama_cpp_model(model, threads, False)
    llm_lookup = llama_cpp_model(model, threads, False, lookup=True)
    if llm is not None:
        from dspark.llamacpp import require_llama_cpp

        run["llama_cpp"] = {
            "version": require_llama_cpp().__version__,
            "file": Path(llm.model_path).name,
            "threads": threads,
        }
    reference = {}  # float32 plain output per dataset: what every precision's plain output is compared with
    for dtype in dtypes:
        target = tune(load_precision(model, dtype))
        if not reference:
            exact = target if dtype == "float32" else Target.load(model, dtype="float32")
            for name in datasets:
                reference[name] = generate_plain(exact, [exact.encode_chat(eval_prompts(name, 1)[0])], max_new_tokens)[
                    0
                ].token_ids
            del exact
        forward_rows(run, target, dtype, counts, context, repeats, llm if dtype == dtypes[0] else None, progress)

        # llama.cpp decodes beside our eager rows and again beside the compiled ones: minutes apart, the host drifts.
        decode = functools.partial(
            decode_rows,
            run,
            target,
            drafter_path=drafter_path,
            datasets=datasets,
            max_new_tokens=max_new_tokens,
            reference=reference,
            llms=(llm_decoding, llm_lookup) if dtype == dtypes[0] else (None, None),
            progress=progress,
        )
        decode(label=dtype)
        if compiled and not target.decoder.compilable:
            progress(f"{dtype}: no compiled step (--compile runs int4)")
        elif compiled:
            compile_target(target)
            ours = profile_target(target, counts, context, repeats)
            times = dict(zip(ours.token_counts, ours.step_time_ms))
            run["forward"].append(
                {"dtype": dtype, "engine": "ours, compiled", "ms": {str(n): ms for n, ms in times.items()}}
            )
            progress(f"{dtype} ours, compiled: {times}")
            decode(label=f"{dtype}, compiled")
        del target
    return run


def forward_rows(run, target, dtype: str, counts, context: int, repeats: int, llm, progress) -> None:
    """Milliseconds per forward of each count of new tokens on a cached context, one row per engine in
    run["forward"]: ours, ours with plain weights where the machine packs them, HF for an unquantized target,
    llama.cpp when given, and the memory-bandwidth bound."""
    from dspark.scheduling.profile import profile_target

    context_ids = torch.randint(0, min(5000, target.vocab_size), (1, context))
    ours = profile_target(target, counts, context, repeats)
    rows = {"ours": dict(zip(ours.token_counts, ours.step_time_ms))}
    if target.decoder.packed:  # the packed weights this machine chose, beside the plain ones
        replaced = profile_target(target.use_packed_weights(False), counts, context, repeats)
        rows["ours, weights not packed"] = dict(zip(replaced.token_counts, replaced.step_time_ms))
        target.use_packed_weights(True)
    if not target.quantized:  # the HF model is not quantized: nothing to compare with there
        rows["hf"] = hf_forward_ms(target, context_ids, counts, repeats)
    if llm is not None:
        rows["llama.cpp"] = llama_forward_ms(llm, context_ids[0].tolist(), counts, repeats)
    bound = round(streamed_bytes(target) / (run["bandwidth_gbs"] * 1e9) * 1000, 2)
    for engine, times in rows.items():
        run["forward"].append(
            {
                "dtype": dtype if engine != "llama.cpp" else "Q4_1",
                "engine": engine,
                "ms": {str(n): ms for n, ms in times.items()},
            }
        )
        progress(f"{dtype} {engine}: {times}")
    run["forward"].append({"dtype": dtype, "engine": "bandwidth bound", "ms": {"1": bound}})


def decode_rows(run, target, label, drafter_path, datasets, max_new_tokens, reference, llms, progress) -> None:
    """Plain and speculative tokens/s on the first prompt of each set (the drafter, suffix decoding and both
    together; fixed γ and scheduled), with HF for an unquantized eager target and llama.cpp (plain, and with its
    prompt-lookup speculation) when given, one row per set in run["decode"]."""
    from dspark.drafter import load_drafter

    engines = warm_dspark_engines(target, load_drafter(drafter_path, target), drafter_path, suffix=True)
    llm, llm_lookup = llms
    generate_plain(target, [target.encode_chat("Hi!")], 4)
    for name in datasets:
        ids = target.encode_chat(eval_prompts(name, 1)[0])
        plain = generate_plain(target, [ids], max_new_tokens)[0]
        row = {
            "dtype": label,
            "dataset": name,
            "ours": round(plain.tokens_per_s, 2),
            "same as float32": common_prefix(plain.token_ids, reference[name]),
        }
        if not target.quantized and target.decoder.compiled is None:
            hf_tokens, seconds = hf_generate(target, ids, max_new_tokens, SamplingParams(), 0)
            row["hf"] = round(len(hf_tokens) / seconds, 2)
        if llm is not None:
            text, count, seconds = llama_generate(llm, ids, max_new_tokens)
            row["llama.cpp"] = round(count / seconds, 2)
        if llm is not None and llm_lookup is not None:
            lookup_text, count, seconds = llama_generate(llm_lookup, ids, max_new_tokens)
            row["llama.cpp lookup"] = round(count / seconds, 2)
            row["llama.cpp lookup identical"] = lookup_text == text
        for engine_name, e in engines.items():
            result = e.generate([ids], max_new_tokens)[0]
            row[engine_name] = round(result.tokens_per_s, 2)
            row[f"{engine_name} tau"] = round(result.stats.tau, 2)
            row[f"{engine_name} identical"] = result.token_ids == plain.token_ids
        run["decode"].append(row)
        progress(str(row))
