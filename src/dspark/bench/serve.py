"""`dspark bench serve`: the server under load on loopback, for each verification policy and concurrency.

For every policy a real server is started on a free loopback port and driven by the official openai client from
`concurrency` threads, each streaming its requests one after another (a bounded number, so the run ends by
itself). Measured per request: time to first token and latency; per run: per-user tokens/s (each request's tokens
over its latency, averaged) and aggregate tokens/s (all tokens over the run's wall time). The Pareto plot puts
per-user speed against throughput, one curve per policy through the concurrency levels.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

from dspark.decoding.engine import SpeculativeEngine
from dspark.decoding.policy import ConfidenceThreshold, FixedLength, VerifyPolicy
from dspark.serve.app import ServeConfig, create_app
from dspark.serve.local import LocalServer


def policies(target, drafter_path, fixed_lengths=(1, 3, 7), threshold: float = 0.5, batch_sizes=(1,)) -> dict:
    """label -> (uses the drafter, policy or None); the schedulers plan with the cost of these batch sizes."""
    from dspark.scheduling.planner import build_scheduler

    out: dict[str, tuple[bool, VerifyPolicy | None]] = {"plain": (False, None)}
    out.update({f"fixed {n}": (True, FixedLength(n)) for n in fixed_lengths})
    out[f"threshold {threshold}"] = (True, ConfidenceThreshold(threshold))
    for kind in ("algorithm1", "production"):
        out[kind] = (True, build_scheduler(target, drafter_path, kind=kind, batch_sizes=batch_sizes))
    return out


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def drive(url: str, model: str, prompts: list[str], concurrency: int, per_stream: int, max_tokens: int) -> dict:
    """`concurrency` clients, each streaming `per_stream` greedy requests back to back."""
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="bench", max_retries=0, timeout=600)

    def one(i: int) -> dict:
        start, first, tokens = time.perf_counter(), None, 0
        stream = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": prompts[i % len(prompts)]}],
            max_tokens=max_tokens,
            temperature=0,
            stream=True,
        )
        for chunk in stream:
            if first is None and chunk.choices and chunk.choices[0].delta.content:
                first = time.perf_counter()
            if chunk.usage:
                tokens = chunk.usage.completion_tokens
        end = time.perf_counter()
        return {"ttft": (first or end) - start, "latency": end - start, "tokens": tokens}

    def client_loop(c: int) -> list[dict]:
        return [one(c * per_stream + k) for k in range(per_stream)]

    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        done = [r for rs in pool.map(client_loop, range(concurrency)) for r in rs]
    wall = time.perf_counter() - start
    return {
        "concurrency": concurrency,
        "requests": len(done),
        "tokens": sum(r["tokens"] for r in done),
        "ttft_p50": round(percentile([r["ttft"] for r in done], 0.5), 3),
        "latency_p50": round(percentile([r["latency"] for r in done], 0.5), 3),
        "latency_p95": round(percentile([r["latency"] for r in done], 0.95), 3),
        "per_user_tps": round(sum(r["tokens"] / r["latency"] for r in done) / len(done), 2),
        "aggregate_tps": round(sum(r["tokens"] for r in done) / wall, 2),
    }


def run_serve_bench(
    target,
    drafter,
    drafter_path,
    prompts: list[str],
    concurrencies,
    max_tokens: int,
    requests_per_level: int,
    progress=print,
) -> list[dict]:
    rows = []
    shapes = tuple(sorted({1, *(n for n in (2, 4, 8, 16, 32) if n <= max(concurrencies))}))
    for label, (speculative, policy) in policies(target, drafter_path, batch_sizes=shapes).items():
        engine = SpeculativeEngine(target, drafter if speculative else None, policy)
        app = create_app(
            engine,
            target.tokenizer,
            ServeConfig("bench", max_batch=max(concurrencies), max_concurrent=2 * max(concurrencies)),
        )
        with LocalServer(app) as server:
            drive(server.url, "bench", prompts, 1, 1, 4)  # warm-up
            for c in concurrencies:
                per_stream = max(1, -(-requests_per_level // c))
                row = {"policy": label, **drive(server.url, "bench", prompts, c, per_stream, max_tokens)}
                rows.append(row)
                progress(str(row))
    return rows
