"""`dspark bench`: τ, acceptance, speed, agreement and memory of every decoding method, side by side in one run.

Methods on the same target, prompts and settings: our plain decoding (the reference), Hugging Face `generate`
(plain) and prompt-lookup decoding (what a CPU user would otherwise pick), and speculative decoding with each
given drafter. Methods are interleaved prompt by prompt, so drift of this shared machine hits all alike; speed
comparisons are ratios within the run.
"""

from __future__ import annotations

import json
import os
import platform
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import psutil
import torch

from dspark.assets import eval_conversations, eval_prompts
from dspark.decoding.engine import SpeculativeEngine
from dspark.decoding.plain import generate_plain
from dspark.decoding.stats import SpecStats, merged
from dspark.drafter.registry import read_checkpoint_meta, training_totals
from dspark.sampling import SamplingParams

PEERS = ("hf", "hf-lookup")


@dataclass
class BenchConfig:
    model: str = "smollm2-135m-instruct"
    datasets: list[str] = field(default_factory=lambda: ["humaneval", "gsm8k", "mt-bench"])
    prompts_per_set: int = 2
    max_new_tokens: int = 64
    temperatures: list[float] = field(default_factory=lambda: [0.0])
    dtypes: list[str] = field(default_factory=lambda: ["float32"])
    drafters: dict[str, str] = field(default_factory=dict)  # label -> checkpoint folder
    peers: list[str] = field(default_factory=lambda: list(PEERS))
    scheduled: bool = False  # also run each drafter with a confidence head under the prefix scheduler
    lookup_tokens: int = 10
    seed: int = 0
    second_turns: bool = False  # the prompts are second turns, after our plain decoding's greedy first answers


class PeakRSS:
    """Peak resident memory of this process while a block runs, sampled every 10 ms."""

    def __init__(self):
        self.proc = psutil.Process()
        self.peak = 0
        self._stop = threading.Event()

    def __enter__(self):
        self.peak = self.proc.memory_info().rss
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()
        return self

    def _watch(self):
        while not self._stop.wait(0.01):
            self.peak = max(self.peak, self.proc.memory_info().rss)

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.proc.memory_info().rss)


def machine_info() -> dict:
    from dspark.autotune import cpu_flags, cpu_name

    cpu = cpu_name()
    flags = cpu_flags()
    import transformers

    import dspark

    wanted = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile", "avx512_vnni")
    return {
        "cpu": cpu,
        "cores": psutil.cpu_count(logical=True),
        "torch_threads": torch.get_num_threads(),
        "cpu_flags": [f for f in wanted if f in flags],
        "memory_gb": round(psutil.virtual_memory().total / 2**30, 1),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "dspark": dspark.__version__,
        "platform": platform.platform(),
    }


def weights_mb(module: torch.nn.Module, skip: tuple[str, ...] = ()) -> float:
    """Bytes held by a module's parameters and buffers (shared target weights excluded by name), in MB."""
    tensors = list(module.named_parameters()) + list(module.named_buffers())
    return round(sum(t.numel() * t.element_size() for n, t in tensors if n not in skip) / 2**20, 3)


def drafter_info(spec: str, proposer) -> dict:
    """What a proposer is: its model's shape, weights and training, and whether suffix trees draft beside it."""
    from dspark.drafter import checkpoint_of, model_drafter
    from dspark.drafter.hybrid import HybridProposer
    from dspark.drafter.suffix import SuffixProposer

    drafter = model_drafter(proposer)
    info = {"path": str(spec), "suffix_trees": isinstance(proposer, (SuffixProposer, HybridProposer))}
    if not hasattr(drafter, "config"):  # the n-gram proposer or suffix decoding alone: tables, no weights
        return info | {
            "weights_mb": 0.0,
            "draft_head_copy_mb": 0.0,
            "architecture": "suffix" if info["suffix_trees"] else "ngram",
            "block_size": drafter.block_size,
            "num_draft_layers": 0,
            "markov_rank": 0,
            "params_millions": 0.0,
            "training": None,
            "preset": None,
        }
    meta = read_checkpoint_meta(checkpoint_of(spec))
    own = weights_mb(drafter, skip=("embed_weight", "lm_head_weight"))
    lm_slice = 0.0 if drafter.d2t is None else round(drafter.lm_weight(drafter.fc.weight.dtype).numel() * 4 / 2**20, 1)
    return info | {
        "weights_mb": own,
        "draft_head_copy_mb": lm_slice,
        "architecture": drafter.config.architecture + (" + suffix" if info["suffix_trees"] else ""),
        "block_size": drafter.block_size,
        "num_draft_layers": drafter.config.num_draft_layers,
        "markov_rank": drafter.config.markov_rank,
        "params_millions": round(sum(p.numel() for p in drafter.parameters()) / 1e6, 2),
        "training": training_totals(meta),  # every leg of its lineage, not only the last run
        "preset": meta.get("training", {}).get("preset"),
    }


def hf_generate(target, ids: list[int], max_new_tokens: int, sampling: SamplingParams, lookup: int):
    kwargs = dict(max_new_tokens=max_new_tokens, pad_token_id=target.tokenizer.eos_token_id)
    if sampling.greedy:
        kwargs.update(do_sample=False)
    else:
        kwargs.update(
            do_sample=True, temperature=sampling.temperature, top_k=sampling.top_k or None, top_p=sampling.top_p
        )
    if lookup:
        kwargs.update(prompt_lookup_num_tokens=lookup)
    start = time.perf_counter()
    with torch.no_grad():
        out = target.model.generate(torch.tensor([ids]), **kwargs)
    return out[0, len(ids) :].tolist(), time.perf_counter() - start


def warm_dspark_engines(target, drafter, drafter_path, suffix: bool = False) -> dict[str, SpeculativeEngine]:
    """The DSpark engines a speed benchmark races: the drafter at a fixed γ and under the confidence scheduler with
    this machine's cost table; with `suffix`, where the drafter ships an answer index, also suffix decoding alone
    (fixed γ) and the hybrid (fixed and scheduled). Each is run once on a short prompt, so that no timed run pays a
    first call's costs; the suffix trees are isolated, so no engine drafts from an answer another one just gave."""
    from dspark.decoding.policy import FixedLength
    from dspark.drafter import SUFFIX_PREFIX, load_proposer
    from dspark.drafter.hybrid import attune
    from dspark.drafter.suffix import ANSWER_INDEX, suffix_trees_available
    from dspark.scheduling.planner import build_scheduler

    def scheduled(proposer):
        policy = build_scheduler(target, drafter_path, drafter=drafter)
        return SpeculativeEngine(target, attune(proposer, policy), policy)

    engines = {"dspark": SpeculativeEngine(target, drafter, FixedLength()), "dspark+sched": scheduled(drafter)}
    if suffix and suffix_trees_available() and (Path(drafter_path) / ANSWER_INDEX).is_file():
        trees = load_proposer(f"{SUFFIX_PREFIX}{drafter_path}", target, isolate=True)
        hybrid = load_proposer(drafter_path, target, suffix=True, isolate=True)
        # The scheduled hybrid gets a proposer of its own: it is told that scheduler's temperatures (attune).
        engines["suffix"] = SpeculativeEngine(target, trees, FixedLength())
        engines["dspark+suffix"] = SpeculativeEngine(target, hybrid, FixedLength())
        engines["dspark+suffix+sched"] = scheduled(load_proposer(drafter_path, target, suffix=True, isolate=True))
    warm = target.encode_chat("Hi!")
    for engine in engines.values():
        engine.generate([warm], 4)
    return engines


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many tokens two outputs share before they first differ."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _agreement(a: list[int], b: list[int]) -> float:
    """Share of the reference's tokens reproduced before the first divergence."""
    return common_prefix(a, b) / max(1, len(b))


def bench_prompts(target, dataset: str, cfg: BenchConfig) -> list[list[int]]:
    """The prompts of a set: first turns; or with `second_turns` the second turn after the first one's answer (our
    plain decoding's, greedy, up to max_new_tokens), as a chat client sends it."""
    if not cfg.second_turns:
        return [target.encode_chat(p) for p in eval_prompts(dataset, cfg.prompts_per_set)]
    prompts = []
    for first, second, *_ in eval_conversations(dataset, cfg.prompts_per_set):
        answer = generate_plain(target, [target.encode_chat(first)], cfg.max_new_tokens)[0].token_ids
        messages = [
            {"role": "user", "content": first},
            {"role": "assistant", "content": target.tokenizer.decode(answer, skip_special_tokens=True)},
            {"role": "user", "content": second},
        ]
        prompts.append(target.encode_chat(messages))
    return prompts


def bench_engines(target, cfg: BenchConfig, drafters_meta: dict) -> dict[str, SpeculativeEngine]:
    """One engine per drafter label at its default policy, and with `scheduled` a LABEL+sched engine under the
    prefix scheduler for each drafter that states its confidence; each label's metadata goes into drafters_meta."""
    from dspark.drafter import load_proposer, model_drafter
    from dspark.drafter.hybrid import attune
    from dspark.scheduling.planner import build_scheduler

    drafters = {}
    for label, path in cfg.drafters.items():
        # Isolated: an answer never joins the global tree, so no method drafts a prompt another just answered.
        drafters[label] = load_proposer(path, target, isolate=True)
        drafters_meta[label] = drafter_info(path, drafters[label])
    engines = {label: SpeculativeEngine(target, d) for label, d in drafters.items()}
    for label, d in drafters.items():
        if cfg.scheduled and d.confidence_head is not None:
            policy = build_scheduler(target, cfg.drafters[label], drafter=model_drafter(d))
            engines[f"{label}+sched"] = SpeculativeEngine(target, attune(d, policy), policy)
    return engines


def measure_set(target, engines, methods, prompts, sampling, cfg: BenchConfig) -> dict[str, dict]:
    """Every method on every prompt, interleaved prompt by prompt: tokens, seconds, outputs, round statistics and
    peak memory per method."""
    rows = {m: {"tokens": 0, "seconds": 0.0, "outputs": [], "stats": [], "peak_rss": 0} for m in methods}
    for ids in prompts:
        for m in methods:
            with PeakRSS() as rss:
                if m == "plain":
                    r = generate_plain(target, [ids], cfg.max_new_tokens, sampling)[0]
                    tokens, seconds = r.token_ids, r.seconds
                elif m in PEERS:
                    lookup = cfg.lookup_tokens if m == "hf-lookup" else 0
                    tokens, seconds = hf_generate(target, ids, cfg.max_new_tokens, sampling, lookup)
                else:
                    r = engines[m].generate([ids], cfg.max_new_tokens, sampling)[0]
                    tokens, seconds = r.token_ids, r.seconds
                    rows[m]["stats"].append(r.stats)
            rows[m]["tokens"] += len(tokens)
            rows[m]["seconds"] += seconds
            rows[m]["outputs"].append(tokens)
            rows[m]["peak_rss"] = max(rows[m]["peak_rss"], rss.peak)
    return rows


def result_entry(method: str, row: dict, reference: dict, **where) -> dict:
    """One method's result on one set (where: dtype, temperature, dataset), against plain decoding's `reference`."""
    prompts = len(reference["outputs"])
    entry = {
        **where,
        "method": method,
        "prompts": prompts,
        "tokens": row["tokens"],
        "seconds": round(row["seconds"], 3),
        "tokens_per_s": round(row["tokens"] / row["seconds"], 2) if row["seconds"] else 0.0,
        "speedup_vs_plain": round((row["tokens"] / row["seconds"]) / (reference["tokens"] / reference["seconds"]), 3),
        "identical_to_plain": sum(a == b for a, b in zip(row["outputs"], reference["outputs"])),
        "token_agreement": round(
            sum(_agreement(a, b) for a, b in zip(row["outputs"], reference["outputs"])) / prompts, 4
        ),
        "peak_rss_mb": round(row["peak_rss"] / 2**20, 1),
    }
    if row["stats"]:
        entry["drafter"] = method.split("+")[0]
        s: SpecStats = merged(row["stats"])
        d = s.to_dict()
        parts = {"draft": s.draft_seconds, "verify": s.verify_seconds, "context": s.context_seconds}
        parts["other"] = row["seconds"] - s.prefill_seconds - sum(parts.values())
        entry.update(
            tau=d["tau"],
            accept_by_position=d["accept_by_position"],
            rounds=d["rounds"],
            mean_verified=d["mean_verified"],
            prefill_seconds=round(s.prefill_seconds, 3),
            ms_per_round={k: round(1000 * v / s.rounds, 2) for k, v in parts.items()},
        )
    return entry


PROGRESS_KEYS = ("dtype", "temperature", "dataset", "method", "tokens_per_s", "speedup_vs_plain", "tau")


def run_bench(cfg: BenchConfig, progress=print) -> dict:
    from dspark.autotune import tune
    from dspark.target import Target

    results, drafters_meta, target_mb = [], {}, {}
    for dtype in cfg.dtypes:
        target = tune(Target.load(cfg.model, dtype=dtype))
        target_mb[dtype] = weights_mb(target.model)
        engines = bench_engines(target, cfg, drafters_meta)
        for temperature in cfg.temperatures:
            sampling = SamplingParams(temperature=temperature, seed=cfg.seed)
            methods = ["plain"] + [p for p in cfg.peers if p in PEERS] + list(engines)
            warm = target.encode_chat("Hi!")
            for engine in engines.values():  # one untimed warm-up per path
                engine.generate([warm], 4, sampling)
            generate_plain(target, [warm], 4, sampling)
            for dataset in cfg.datasets:
                rows = measure_set(target, engines, methods, bench_prompts(target, dataset, cfg), sampling, cfg)
                for m in methods:
                    entry = result_entry(
                        m, rows[m], rows["plain"], dtype=dtype, temperature=temperature, dataset=dataset
                    )
                    results.append(entry)
                    progress(json.dumps({k: entry[k] for k in PROGRESS_KEYS if k in entry}))
        del target, engines
    return {
        "config": asdict(cfg),
        "machine": machine_info(),
        "drafters": drafters_meta,
        "results": results,
        "target_weights_mb": target_mb,
        "when": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "threads": torch.get_num_threads(),
        "env": {k: os.environ[k] for k in ("OMP_NUM_THREADS",) if k in os.environ},
    }
