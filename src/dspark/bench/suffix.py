"""`dspark bench suffix`: what suffix decoding's global tree buys per answer loaded, and how far its probabilities
can be trusted; and the calibration `dspark suffix-index` stores beside the answers.

No model runs: held-out answers the target wrote greedily (regenerated records the drafter never trained on) are
walked as greedy verification walks them. Each round the trees draft from the prompt and the answer so far, the
round accepts the longest prefix of drafts equal to the answer, and the next token is the answer's. For each size of
global tree (answers drawn from the same data, none of them held out): τ, the tree's memory and its load time. For
the largest tree: each drafted position's count-based probability against whether it survived (given that the ones
before it did), per position and per length of the context match it came from, before and after a Platt scaling
per match group and position fitted on the other half of the held-out answers (what the hybrid and the scheduler
read as the tree's confidence).
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

from dspark.bench.report import save_figure, section_header
from dspark.drafter.suffix import MATCH_BUCKETS, SuffixProposer, match_bucket, write_answer_index
from dspark.sampling import SamplingParams
from dspark.scheduling.calibration import ece, fit_platt

PROB_BINS = 10
MIN_FIT = 50  # verified positions a (match group, position) needs before its own scaling is fitted


def bucket_name(i: int) -> str:
    lo = MATCH_BUCKETS[i]
    hi = MATCH_BUCKETS[i + 1] - 1 if i + 1 < len(MATCH_BUCKETS) else None
    return f"{lo}+" if hi is None else (str(lo) if hi == lo else f"{lo}-{hi}")


def walk(proposer: SuffixProposer, prompt: list[int], answer: list[int]) -> tuple[list[int], list[tuple]]:
    """One answer decoded greedily against its own text: the tokens each round produced, and per drafted position
    that was verified (its predecessors survived) (position, match length, confidence logit, survived)."""
    cache = proposer.new_cache(1)
    proposer.extend_context(cache, None, torch.tensor([len(prompt)]), torch.tensor([prompt[1:] + answer[:1]]))
    produced, drafted, pos = [], [], 1
    anchor, greedy = torch.zeros(1, dtype=torch.long), SamplingParams()
    while pos < len(answer):
        proposal = proposer.propose(cache, anchor, greedy)
        n = int(proposal.lengths[0])
        logits = proposal.confidence_logits[0, :n].tolist()
        accepted = 0
        for k, (token, logit) in enumerate(zip(proposal.tokens[0, :n].tolist(), logits)):
            survived = pos + k < len(answer) and token == answer[pos + k]
            drafted.append((k, cache.match_lengths[0], logit, survived))
            if not survived:
                break
            accepted += 1
        new = answer[pos : pos + accepted + 1]
        produced.append(len(new))
        proposer.extend_context(cache, None, torch.tensor([len(new)]), torch.tensor([new]))
        pos += len(new)
    cache.select(torch.zeros(0, dtype=torch.long))  # the request ends: its tree goes
    return produced, drafted


def walk_all(proposer: SuffixProposer, pairs) -> tuple[list[int], list[list[tuple]], float]:
    """Every (prompt, answer) walked: tokens per round, each answer's drafted positions, and the seconds taken."""
    produced, drafted, start = [], [], time.perf_counter()
    for prompt, answer in pairs:
        rounds, positions = walk(proposer, prompt, answer)
        produced += rounds
        drafted.append(positions)
    return produced, drafted, time.perf_counter() - start


def fit_tree_calibration(drafted: list[tuple], block_size: int) -> torch.Tensor:
    """Platt scaling per (match group, position) [len(MATCH_BUCKETS), γ, 2]; a group with fewer than MIN_FIT
    verified positions keeps the scaling of its match group fitted over all positions (or the identity)."""
    table = torch.tensor([1.0, 0.0]).repeat(len(MATCH_BUCKETS), block_size, 1)
    cells: dict[tuple[int, int], list[tuple[float, bool]]] = defaultdict(list)
    for k, match, logit, survived in drafted:
        cells[(match_bucket(match), k)].append((logit, survived))
    for m in range(len(MATCH_BUCKETS)):
        group = [x for k in range(block_size) for x in cells[(m, k)]]
        if len(group) >= MIN_FIT:
            table[m, :] = torch.tensor(_platt(group))
        for k in range(block_size):
            if len(cells[(m, k)]) >= MIN_FIT:
                table[m, k] = torch.tensor(_platt(cells[(m, k)]))
    return table


def _platt(items: list[tuple[float, bool]]) -> tuple[float, float]:
    return fit_platt(torch.tensor([x for x, _ in items]), torch.tensor([y for _, y in items]))


def calibrated(drafted: list[tuple], table: torch.Tensor) -> list[tuple]:
    out = []
    for k, match, logit, survived in drafted:
        a, b = table[match_bucket(match), k].tolist()
        out.append((k, match, a * logit + b, survived))
    return out


def split_answers(target, paths, holdout: float, max_length: int) -> tuple[list[list[int]], list[tuple]]:
    """Regenerated data split as training splits it: every training answer, and the held-out records' (prompt, first
    answer) pairs."""
    from dspark.training.anchors import answer_spans
    from dspark.training.batches import load_examples

    pool, held = [], []
    for path in paths:
        train, held_out, _ = load_examples(target, path, max_length, holdout)
        pool += [e.input_ids[a : a + n] for e in train for a, n in answer_spans(torch.tensor(e.loss_mask))]
        for e in held_out:
            start, length = answer_spans(torch.tensor(e.loss_mask))[0]
            held.append((e.input_ids[:start], e.input_ids[start : start + length]))
    return pool, held


def unseen_pairs(held: list[tuple], seen: list[list[int]], count: int) -> list[tuple]:
    """At most `count` held-out pairs spread over the list (every data file in it), leaving out answers of one token
    and answers the trees hold."""
    known = {tuple(a) for a in seen}
    pairs = [(p, a) for p, a in held if len(a) > 1 and tuple(a) not in known]
    return [pairs[i * len(pairs) // count] for i in range(count)] if len(pairs) > count else pairs


# Run in a fresh process, so that memory this one freed earlier cannot hide what the tree takes.
_BUILD_TREE = """
import gc, json, sys, time
import psutil
from dspark.drafter.suffix import SuffixProposer, read_answer_index
answers = read_answer_index(sys.argv[1]).answers
gc.collect()
before, start = psutil.Process().memory_info().rss, time.perf_counter()
tree = SuffixProposer(int(sys.argv[2]), int(sys.argv[3]), answers, max_cached=max(len(answers), 1), isolate=True)
seconds = time.perf_counter() - start
print(json.dumps({"memory_mb": (psutil.Process().memory_info().rss - before) / 2**20, "load_seconds": seconds}))
"""


def tree_cost(answers: list[list[int]], vocab_size: int, block_size: int) -> dict:
    """The memory a global tree of these answers takes and the seconds it takes to build, in a fresh process."""
    with tempfile.TemporaryDirectory() as tmp:
        index = Path(tmp) / "answers.safetensors"
        write_answer_index(answers, index)
        out = subprocess.run(
            [sys.executable, "-c", _BUILD_TREE, str(index), str(vocab_size), str(block_size)],
            capture_output=True,
            text=True,
            check=True,
        )
    return json.loads(out.stdout)


def run_suffix_bench(
    pool: list[list[int]],
    held_out: list[tuple[list[int], list[int]]],
    sizes: list[int],
    block_size: int,
    vocab_size: int,
    seed: int = 0,
    progress=print,
) -> dict:
    """pool: answers the global tree may load (drawn in a seeded order, the smaller trees' answers a prefix of the
    larger ones'); held_out: (prompt, answer) pairs walked against each tree. Each tree's memory and build time are
    measured in a process of its own (what its resident memory grew by while the tree was built)."""
    random.Random(seed).shuffle(pool)
    rows, drafted = [], []
    for size in sorted(sizes):
        cost = tree_cost(pool[:size], vocab_size, block_size)
        proposer = SuffixProposer(vocab_size, block_size, pool[:size], max_cached=max(size, 1), isolate=True)
        produced, drafted, walk_seconds = walk_all(proposer, held_out)
        del proposer
        row = {
            "answers": min(size, len(pool)),
            "tokens": sum(map(len, pool[:size])),
            "tau": round(sum(produced) / len(produced), 3),
            "rounds": len(produced),
            "memory_mb": round(cost["memory_mb"], 1),
            "load_seconds": round(cost["load_seconds"], 2),
            "ms_per_round": round(1000 * walk_seconds / len(produced), 3),
        }
        rows.append(row)
        progress(row)
    fit = [p for answer in drafted[0::2] for p in answer]  # half the answers fit the scaling, the rest judge it
    judged = [p for answer in drafted[1::2] for p in answer]
    table = fit_tree_calibration(fit, block_size)
    return {
        "block_size": block_size,
        "held_out": len(held_out),
        "held_out_tokens": sum(len(a) for _, a in held_out),
        "pool": len(pool),
        "sizes": rows,
        "calibration": {"raw": reliability(judged), "calibrated": reliability(calibrated(judged, table))},
        "platt": table.tolist(),
    }


def reliability(drafted: list[tuple]) -> dict:
    """Predicted against observed survival: per position, per match group, and per probability bin and match
    group (the reliability diagram), with the expected calibration error over all verified positions."""

    def cell(items) -> dict:
        return {
            "count": len(items),
            "predicted": round(sum(p for p, _ in items) / len(items), 4),
            "observed": round(sum(s for _, s in items) / len(items), 4),
        }

    by_position, by_match = defaultdict(list), defaultdict(list)
    curves: dict[int, dict[int, list]] = defaultdict(lambda: defaultdict(list))
    for k, match, logit, survived in drafted:
        p, m = torch.sigmoid(torch.tensor(logit)).item(), match_bucket(match)
        by_position[k + 1].append((p, survived))
        by_match[m].append((p, survived))
        curves[m][min(int(p * PROB_BINS), PROB_BINS - 1)].append((p, survived))
    pairs = [x for items in by_position.values() for x in items]
    return {
        "positions": len(pairs),
        "ece": round(ece(torch.tensor([p for p, _ in pairs]), torch.tensor([s for _, s in pairs])), 4),
        "by_position": {str(k): cell(v) for k, v in sorted(by_position.items())},
        "by_match": {bucket_name(m): cell(v) for m, v in sorted(by_match.items())},
        "curves": {bucket_name(m): {str(b): cell(v) for b, v in sorted(c.items())} for m, c in sorted(curves.items())},
    }


def suffix_section(run: dict, command: str, plot: str, name: str = "suffix") -> str:
    m, raw, cal = run["machine"], run["calibration"]["raw"], run["calibration"]["calibrated"]
    out = [
        *section_header(f"## {name}", command, run["when"]),
        f"Machine: {m['cpu']}, torch {m['torch']}. No model runs: {run['held_out']} held-out answers the target "
        f"wrote greedily ({run['held_out_tokens']} tokens, from {', '.join(run['data'])}) decoded against their own "
        f"text, up to {run['block_size']} drafts a round from the trees of the prompt, the answer so far and a "
        f"global tree of answers drawn from the other {run['pool']} answers. Memory: what a fresh process grew by while "
        "it built the tree.",
        "",
        "| answers in the global tree | tokens | τ | memory (MB) | load (s) | ms per round |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for r in run["sizes"]:
        out.append(
            f"| {r['answers']} | {r['tokens']} | {r['tau']:.2f} | {r['memory_mb']:.0f} | {r['load_seconds']:.2f} "
            f"| {r['ms_per_round']:.3f} |"
        )
    out += [
        "",
        f"Calibration with the largest tree, on the {raw['positions']} verified drafted positions of every other "
        "held-out answer (the scaling was fitted on the rest): the tree's count-based probability (raw) and after "
        f"Platt scaling per match group and position, against observed survival. Expected calibration error "
        f"{raw['ece']:.3f} raw, {cal['ece']:.3f} calibrated.",
        "",
        "| slice | positions | raw | calibrated | observed |",
        "| --- | --- | --- | --- | --- |",
    ]
    for kind, label in (("by_position", "position {}"), ("by_match", "match {} tokens")):
        for key, c in raw[kind].items():
            after = cal[kind][key]["predicted"]
            out.append(
                f"| {label.format(key)} | {c['count']} | {c['predicted']:.3f} | {after:.3f} | {c['observed']:.3f} |"
            )
    out += ["", f"![suffix decoding: τ against answers loaded, and calibration]({plot})", ""]
    return "\n".join(out)


def suffix_plot(run: dict, path: Path) -> Path:
    from dspark.extras import pyplot

    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    sizes = run["sizes"]
    xs = [max(r["answers"], 1) for r in sizes]
    axes[0].plot(xs, [r["tau"] for r in sizes], marker="o", color="tab:blue")
    axes[0].set(xscale="log", xlabel="answers in the global tree (0 drawn at 1)", ylabel="τ", title="τ and memory")
    twin = axes[0].twinx()
    twin.plot(xs, [r["memory_mb"] for r in sizes], marker="s", color="tab:orange")
    twin.set_ylabel("memory (MB)", color="tab:orange")
    for ax, kind in zip(axes[1:], ("raw", "calibrated")):
        ax.plot([0, 1], [0, 1], linestyle="--", color="grey", linewidth=1)
        for match, bins in run["calibration"][kind]["curves"].items():
            cells = [c for c in bins.values() if c["count"] >= 20]
            ax.plot([c["predicted"] for c in cells], [c["observed"] for c in cells], marker="o", label=f"match {match}")
        ax.set(
            xlabel=f"the tree's probability, {kind}",
            ylabel="observed survival",
            xlim=(0, 1),
            ylim=(0, 1),
            title=f"{kind} (ECE {run['calibration'][kind]['ece']:.3f}; bins of ≥ 20)",
        )
        ax.legend(fontsize=7)
    for ax in axes:
        ax.grid(alpha=0.3)
    path.parent.mkdir(parents=True, exist_ok=True)
    return save_figure(fig, path)
