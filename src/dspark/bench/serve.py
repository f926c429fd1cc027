"""`dspark bench serve`: the server under load on loopback, for each verification policy and concurrency.

For every policy and repetition a real server is started on a free loopback port and driven by the official openai
client from `concurrency` threads, each streaming greedy requests back to back until the level has seen its share
(at least `min_requests` requests or `min_tokens` generated tokens). Measured per level: per-user tokens/s (each
request's tokens over its latency, averaged), aggregate tokens/s (all tokens over the level's wall time), time to
first token and latency, and from the server's /metrics: τ, the tokens the policy predicted against those its rounds
yielded, and the ECE of its survival estimates. Repetitions give 95 % intervals; per-user speed at matched
throughput is read off a baseline's curve by interpolation.

Every finished level is appended to `levels.jsonl` in the output folder: a killed run started again with the same
settings skips the levels it already has.
"""

from __future__ import annotations

import json
import math
import multiprocessing
import threading
import time
import urllib.request
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from pathlib import Path

import torch

from dspark.decoding.engine import SpeculativeEngine
from dspark.decoding.policy import ConfidenceThreshold, FixedLength, VerifyPolicy
from dspark.drafter.hybrid import attune
from dspark.scheduling.calibration import ece_from_bins
from dspark.scheduling.profile import batch_sizes_up_to
from dspark.serve.app import ServeConfig, create_app
from dspark.serve.local import LocalServer

SCHEDULED = ("algorithm1", "production")

# Two-sided 95 % Student t quantiles by degrees of freedom (repetitions - 1).
T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262}


def policies(
    target, drafter, drafter_path, fixed_lengths=(1, 2, 3, 4, 5, 6, 7), thresholds=(0.5,), batch_sizes=(1,)
) -> dict[str, tuple[bool, VerifyPolicy | None]]:
    """label -> (uses the drafter, policy or None); the schedulers plan with the cost of these batch sizes."""
    from dspark.drafter import model_drafter
    from dspark.scheduling.planner import build_scheduler

    out: dict[str, tuple[bool, VerifyPolicy | None]] = {"plain": (False, None)}
    out.update({f"fixed {n}": (True, FixedLength(n)) for n in fixed_lengths})
    out.update({f"threshold {t}": (True, ConfidenceThreshold(t)) for t in thresholds})
    for kind in SCHEDULED:
        scheduler = build_scheduler(
            target, drafter_path, kind=kind, batch_sizes=batch_sizes, drafter=model_drafter(drafter)
        )
        out[kind] = (True, scheduler)
    return out


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def scrape(url: str) -> dict[tuple, float]:
    """The server's /metrics as {(sample name, sorted labels): value}."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url + "/metrics", timeout=30) as response:
        text = response.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def round_metrics(before: dict, after: dict) -> dict:
    """What the server's counters say of the rounds between two scrapes: τ, the share of rounds that drafted,
    predicted against realised tokens per round, the ECE of the survival estimates of every verified draft, and the
    scheduled rounds' wall time against what the cost table priced them at."""

    def delta(name: str, **labels) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    rounds = delta("dspark_rounds_total")
    out: dict = {"rounds": int(rounds)}
    if rounds:
        out["tau"] = round((rounds + delta("dspark_accepted_draft_tokens_total")) / rounds, 3)
        out["verified_per_round"] = round(delta("dspark_verified_draft_tokens_total") / rounds, 3)
        out["drafted_share"] = round(delta("dspark_drafted_rounds_total") / rounds, 3)
    priced = delta("dspark_scheduled_round_priced_seconds_total")
    if priced:
        out["time_over_price"] = round(delta("dspark_scheduled_round_seconds_total") / priced, 3)
    realised = delta("dspark_round_tokens_total")
    if realised:
        out["predicted_over_realised"] = round(delta("dspark_predicted_round_tokens_total") / realised, 3)
    cells = [dict(labels) for name, labels in after if name == "dspark_calibration_drafts_total"]
    bins = []  # per kind: per estimate bin, summed over draft positions
    for kind in ("drafts", "predicted", "survived"):
        by_bin: dict[str, float] = {}
        for cell in cells:
            by_bin[cell["bin"]] = by_bin.get(cell["bin"], 0.0) + delta(f"dspark_calibration_{kind}_total", **cell)
        bins.append([by_bin[b] for b in sorted(by_bin)])
    if cells and sum(bins[0]):
        out["ece"] = round(ece_from_bins(*bins), 4)
    return out


def drive(url: str, model: str, prompts: list[str], concurrency: int, min_requests: int, min_tokens: int, max_tokens):
    """`concurrency` clients streaming greedy requests back to back until the level has at least `min_requests`
    requests or `min_tokens` tokens (every client sends one at least). Returns the per-request records and the
    level's wall time."""
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="bench", max_retries=0, timeout=1200)
    lock, state = threading.Lock(), {"started": 0, "tokens": 0}

    def one(i: int) -> dict:
        start, first, tokens = time.perf_counter(), None, 0
        stream = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": prompts[i % len(prompts)]}],
            max_tokens=max_tokens,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        for chunk in stream:
            if first is None and chunk.choices and chunk.choices[0].delta.content:
                first = time.perf_counter()
            if chunk.usage:
                tokens = chunk.usage.completion_tokens
        end = time.perf_counter()
        return {"ttft": (first or end) - start, "latency": end - start, "tokens": tokens}

    def client_loop(c: int) -> list[dict]:
        done = []
        while True:
            with lock:
                enough = state["started"] >= min_requests or state["tokens"] >= min_tokens
                if done and enough:
                    return done
                i, state["started"] = state["started"], state["started"] + 1
            done.append(one(i))
            with lock:
                state["tokens"] += done[-1]["tokens"]

    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        records = [r for rs in pool.map(client_loop, range(concurrency)) for r in rs]
    return records, time.perf_counter() - start


def level_row(records: list[dict], wall: float) -> dict:
    return {
        "requests": len(records),
        "tokens": sum(r["tokens"] for r in records),
        "seconds": round(wall, 2),
        "ttft_p50": round(percentile([r["ttft"] for r in records], 0.5), 3),
        "latency_p50": round(percentile([r["latency"] for r in records], 0.5), 3),
        "latency_p95": round(percentile([r["latency"] for r in records], 0.95), 3),
        "per_user_tps": round(sum(r["tokens"] / r["latency"] for r in records) / len(records), 2),
        "aggregate_tps": round(sum(r["tokens"] for r in records) / wall, 2),
    }


def run_serve_bench(
    target,
    drafter,
    drafter_path,
    prompts: list[str],
    concurrencies,
    max_tokens: int,
    min_requests: int,
    min_tokens: int,
    repetitions: int,
    out: Path,
    fixed_lengths=(1, 2, 3, 4, 5, 6, 7),
    thresholds=(0.5,),
    progress=print,
) -> list[dict]:
    """One row per (repetition, policy, concurrency). Levels already in out/levels.jsonl from a run with the same
    settings are not measured again, and every level logged with these settings is returned: runs of some policies
    at more repetitions than others add up in one report."""
    settings = {
        "max_tokens": max_tokens,
        "min_requests": min_requests,
        "min_tokens": min_tokens,
        "prompts": len(prompts),
        "dtype": target.precision,  # int4 and bfloat16 compute alike but are different runs
        "threads": torch.get_num_threads(),
    }
    out.mkdir(parents=True, exist_ok=True)
    log = out / "levels.jsonl"
    done = logged_levels(log, settings)
    # The schedulers plan with the batch shapes a server of this many rows profiles (as `dspark serve` does).
    shapes = batch_sizes_up_to(max(concurrencies))
    table = policies(target, drafter, drafter_path, fixed_lengths, thresholds, batch_sizes=shapes)
    # The clients run in a process of their own, as they would on another machine: their threads do not share the
    # server's interpreter lock.
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as clients:
        for rep in range(repetitions):
            for label, (speculative, policy) in table.items():
                todo = [c for c in concurrencies if (rep, label, c) not in done]
                if not todo:
                    continue
                engine = SpeculativeEngine(target, attune(drafter, policy) if speculative else None, policy)
                config = ServeConfig("bench", max_batch=max(concurrencies), max_concurrent=2 * max(concurrencies))
                with LocalServer(create_app(engine, target.tokenizer, config)) as server:
                    clients.submit(drive, server.url, "bench", prompts, 1, 1, 1, 4).result()  # warm-up
                    for c in todo:
                        before = scrape(server.url)
                        level = (server.url, "bench", prompts, c, min_requests, min_tokens, max_tokens)
                        records, wall = clients.submit(drive, *level).result()
                        row = {
                            "repetition": rep,
                            "policy": label,
                            "concurrency": c,
                            **level_row(records, wall),
                            **round_metrics(before, scrape(server.url)),
                            "settings": settings,
                        }
                        with log.open("a") as f:
                            f.write(json.dumps(row) + "\n")
                        progress(json.dumps({k: v for k, v in row.items() if k != "settings"}))
    order = {label: i for i, label in enumerate(table)}
    return sorted(
        logged_levels(log, settings).values(),
        key=lambda r: (order.get(r["policy"], len(order)), r["policy"], r["concurrency"], r["repetition"]),
    )


def logged_levels(log: Path, settings: dict) -> dict[tuple, dict]:
    """(repetition, policy, concurrency) -> the level's row, for every level in the log measured with `settings`."""
    done = {}
    if log.exists():
        for line in log.read_text().splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut short by a kill
            if row.get("settings") == settings:
                done[(row["repetition"], row["policy"], row["concurrency"])] = row
    return done


def mean_interval(values: list[float]) -> tuple[float, float | None]:
    """Mean and the half-width of its 95 % t interval (None from one value)."""
    n = len(values)
    mean = sum(values) / n
    if n < 2:
        return mean, None
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    return mean, T95.get(n - 1, 1.96) * sd / math.sqrt(n)


def summarise(rows: list[dict]) -> list[dict]:
    """One row per (policy, concurrency): means over repetitions with 95 % intervals."""
    out = []
    for policy in dict.fromkeys(r["policy"] for r in rows):
        for c in sorted({r["concurrency"] for r in rows if r["policy"] == policy}):
            reps = [r for r in rows if r["policy"] == policy and r["concurrency"] == c]
            row = {"policy": policy, "concurrency": c, "repetitions": len(reps)}
            for key in ("per_user_tps", "aggregate_tps"):
                mean, half = mean_interval([r[key] for r in reps])
                row[key], row[key + "_ci"] = round(mean, 2), None if half is None else round(half, 2)
            for key in ("requests", "tokens", "ttft_p50", "latency_p50", "latency_p95"):
                row[key] = round(sum(r[key] for r in reps) / len(reps), 3)
            for key in (
                "tau",
                "verified_per_round",
                "drafted_share",
                "predicted_over_realised",
                "ece",
                "time_over_price",
            ):
                values = [r[key] for r in reps if key in r]
                if values:
                    row[key] = round(sum(values) / len(values), 4)
            out.append(row)
    return out


def speed_at_throughput(curve: list[dict], aggregate: float) -> float | None:
    """A policy's per-user tokens/s at this aggregate throughput, by linear interpolation along its curve through
    the concurrency levels, in their order. Where the curve passes that throughput more than once (its throughput
    falls again past a saturating load), the best per-user speed among the passes. Below its one-stream throughput:
    its one-stream speed (it cannot serve fewer than one stream); never reached: None."""
    points = [(r["aggregate_tps"], r["per_user_tps"]) for r in sorted(curve, key=lambda r: r["concurrency"])]
    if aggregate <= points[0][0]:
        return points[0][1]
    passes = [
        y0 if x0 == x1 else y0 + (y1 - y0) * (aggregate - x0) / (x1 - x0)
        for (x0, y0), (x1, y1) in zip(points, points[1:])
        if min(x0, x1) <= aggregate <= max(x0, x1)
    ]
    return max(passes, default=None)


def matched_throughput(summary: list[dict], policy: str, baseline: str) -> dict[int, float | None]:
    """concurrency -> per-user speed of `policy` over `baseline`'s at the same aggregate throughput (None where the
    baseline never reaches it: the policy is faster per user and serves more than the baseline can)."""
    curve = [r for r in summary if r["policy"] == baseline]
    out = {}
    for r in summary:
        if r["policy"] == policy and curve:
            base = speed_at_throughput(curve, r["aggregate_tps"])
            out[r["concurrency"]] = None if base is None else round(r["per_user_tps"] / base, 3)
    return out


def best_fixed(summary: list[dict], concurrency: int) -> dict:
    """The best of plain decoding and every fixed length at this concurrency, by aggregate throughput."""
    level = [r for r in summary if r["concurrency"] == concurrency]
    return max(
        (r for r in level if r["policy"] == "plain" or r["policy"].startswith("fixed")),
        key=lambda r: r["aggregate_tps"],
    )
