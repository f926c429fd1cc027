"""`dspark bench signal`: where a drafter's acceptance is lost, position by position.

Every slice is text the target itself wrote: some training records, the held-out records, and the target's own
greedy answers to evaluation prompts. The drafter is run teacher-forced at every answer position of each (what
training optimises), and the evaluation prompts are also decoded for real. Read together:
- teacher-forced at every position, training vs held-out: equal means the drafter underfits (more optimisation
  helps), training far above held-out means it overfits (more data helps);
- teacher-forced along the rounds greedy decoding takes (each anchor one past the last accepted draft) must equal
  real decoding: a difference is a train/inference mismatch (features, masks, precision), not a data problem;
- every position vs along the rounds: an easy stretch goes in a few long rounds while each hard token costs a
  round of its own, so decoding's rounds are dominated by the hard positions;
- the target's own probability of each next token of the text: where the target itself is unsure (near ties), its
  greedy choice is hard to foresee from one position back, whatever the drafter.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from dspark.bench.report import save_figure, section_header
from dspark.decoding.engine import SpeculativeEngine
from dspark.decoding.policy import FixedLength
from dspark.decoding.stats import SpecStats
from dspark.records import Example
from dspark.training.anchors import anchor_candidates, answer_spans, decoding_rounds, leading_runs


@dataclass
class LeadingRuns:
    """A finished answer scored teacher-forced at every anchor: how many drafts in a row equal the text after it."""

    spans: list[tuple[int, int]]  # (first position, length) of each answer
    anchors: torch.Tensor  # [A] positions p with p and p+1 in the answer
    runs: torch.Tensor  # [A] leading run of drafts equal to the text after p
    full: torch.Tensor  # [A] all γ labels after p lie inside the answer
    target_p: torch.Tensor  # [A] the target's probability of the text's token at p+1


@torch.no_grad()
def score_answer(drafter, target, example: Example) -> LeadingRuns:
    """One target forward and one drafter pass over the whole example, every answer position an anchor."""
    ids = torch.tensor([example.input_ids])
    mask = torch.tensor([example.loss_mask])
    out = target.forward_sequences(ids, features=drafter.target_layer_ids)
    runs = leading_runs(drafter, out.features, ids, mask)[0]
    anchors = anchor_candidates(mask)[0].nonzero()[:, 0]
    label_pos = anchors[:, None] + torch.arange(1, drafter.block_size + 1)
    full = (label_pos < ids.shape[1]).all(-1) & mask[0].bool()[label_pos.clamp(max=ids.shape[1] - 1)].all(-1)
    target_p = out.logits[0, anchors].float().softmax(-1).gather(-1, ids[0, anchors + 1, None])[:, 0]
    return LeadingRuns(answer_spans(mask[0]), anchors, runs[anchors], full, target_p)


def every_position(scored: list[LeadingRuns], gamma: int) -> SpecStats:
    """Teacher-forced acceptance over every anchor whose whole block lies inside the answer (γ verified)."""
    stats = SpecStats(gamma)
    for answer in scored:
        for run in answer.runs[answer.full].tolist():
            stats.record(gamma, run)
    return stats


def along_rounds(scored: list[LeadingRuns], gamma: int) -> SpecStats:
    """Teacher-forced acceptance at the anchors greedy decoding at a fixed γ visits in each answer
    (`decoding_rounds`): for text the target wrote greedily, what decoding its prompt would accept."""
    stats = SpecStats(gamma)
    for answer in scored:
        run_at = dict(zip(answer.anchors.tolist(), answer.runs.tolist()))
        for first, length in answer.spans:
            for _, verified, accepted in decoding_rounds(first, length, gamma, run_at.__getitem__):
                stats.record(verified, accepted)
    return stats


def signal_report(
    drafter,
    target,
    slices: dict[str, list[Example]],
    prompts: dict[str, list[list[int]]],
    max_new_tokens: int,
    progress=print,
) -> list[dict]:
    """One row per slice: teacher-forced τ and acceptance by position at every position and along the decoding rounds;
    for evaluation prompts also in real greedy decoding (float32 output of the engine, no stop tokens, so every
    answer runs to max_new_tokens and the rounds are comparable one to one)."""
    gamma, rows = drafter.block_size, []
    for name, examples in slices.items():
        if not examples:  # a run trained with --holdout 0 has no held-out slice
            continue
        scored = [score_answer(drafter, target, e) for e in examples]
        rows.append(
            row(
                name,
                "training data" if name == "train" else "held-out",
                every_position(scored, gamma),
                rounds=along_rounds(scored, gamma),
                target_p=torch.cat([a.target_p for a in scored]),
            )
        )
        progress(rows[-1])
    engine = SpeculativeEngine(target, drafter, FixedLength())
    for name, ids in prompts.items():
        real, scored = SpecStats(gamma), []
        for prompt, result in zip(ids, engine.generate(ids, max_new_tokens, stop_token_ids=set())):
            real = real.merge(result.stats)
            answer = Example(prompt + result.token_ids, [0] * len(prompt) + [1] * len(result.token_ids))
            scored.append(score_answer(drafter, target, answer))
        rows.append(
            row(
                name,
                "target's answers",
                every_position(scored, gamma),
                rounds=along_rounds(scored, gamma),
                real=real,
                target_p=torch.cat([a.target_p for a in scored]),
            )
        )
        progress(rows[-1])
    return rows


def row(
    name: str,
    kind: str,
    tf: SpecStats,
    rounds: SpecStats | None = None,
    real: SpecStats | None = None,
    target_p: torch.Tensor | None = None,
) -> dict:
    out = {
        "slice": name,
        "text": kind,
        "anchors": tf.rounds,
        "tf_tau": round(tf.tau, 4),
        "tf_accept_by_position": [None if p is None else round(p, 4) for p in tf.accept_by_position()],
    }
    if target_p is not None:
        out["target_p_mean"] = round(target_p.mean().item(), 4)
        out["target_p_below_half"] = round((target_p < 0.5).float().mean().item(), 4)
    for key, stats in (("rounds", rounds), ("real", real)):
        if stats is not None:
            out[f"{key}_tau"] = round(stats.tau, 4)
            out[f"{key}_accept_1"] = round(stats.accept_by_position()[0] or 0.0, 4)
            out[f"{key}_rounds"] = stats.rounds
    return out


def signal_section(run: dict, command: str, plot: str, name: str = "signal") -> str:
    def cell(x):
        return "–" if x is None else f"{x:.2f}"

    m = run["machine"]
    machine = (
        f"Machine: {m['cpu']}, {m['cores']} cores, torch threads {m['torch_threads']}, flags "
        f"{', '.join(m['cpu_flags']) or 'n/a'}; target {run['dtype']}; drafter `{run['drafter']}`."
    )
    legend = (
        "τ = 1 + accepted drafts per round (greedy, fixed γ). *Teacher-forced*: the drafter on the text at every "
        "answer position, as training measures it; *along rounds*: at the anchors greedy decoding visits (on text "
        "the target wrote greedily, what decoding its prompt accepts); "
        "*real*: decoded by the engine. In float32, along rounds must equal real (else training and inference "
        "disagree); training ≈ held-out means the drafter underfits, training ≫ held-out that it overfits. "
        "*Target p*: the target's mean probability of the text's next token, and the share of positions where "
        "it is below 0.5 (near ties the target itself is unsure of)."
    )
    header = (
        "| slice | text | anchors | teacher-forced τ | accept pos 1 / 2 / 3 (teacher-forced) | along rounds τ "
        "| real τ | real accept pos 1 | target p (share < 0.5) |"
    )
    out = [
        *section_header(f"## {name}: training signal by position", command, run["when"]),
        machine,
        "",
        legend,
        "",
        header,
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in run["rows"]:
        acc = " / ".join(cell(p) for p in r["tf_accept_by_position"][:3])
        confidence = "–" if "target_p_mean" not in r else f"{r['target_p_mean']:.2f} ({r['target_p_below_half']:.2f})"
        out.append(
            f"| {r['slice']} | {r['text']} | {r['anchors']} | {r['tf_tau']:.2f} | {acc} | "
            f"{cell(r.get('rounds_tau'))} | {cell(r.get('real_tau'))} | {cell(r.get('real_accept_1'))} | "
            f"{confidence} |"
        )
    out += ["", f"![acceptance by position]({plot})", ""]
    return "\n".join(out)


def signal_plot(rows: list[dict], path: Path) -> Path:
    """Teacher-forced acceptance by draft position, one line per slice."""
    from dspark.extras import pyplot

    plt = pyplot()

    fig, ax = plt.subplots(figsize=(7, 4))
    for r in rows:
        acc = r["tf_accept_by_position"]
        ax.plot(
            range(1, len(acc) + 1),
            [float("nan") if a is None else a for a in acc],
            marker="o",
            linestyle="-" if r["text"] == "target's answers" else "--",
            label=f"{r['slice']} (τ {r['tf_tau']:.2f})",
        )
    ax.set_xlabel("draft position k")
    ax.set_ylabel("P(accept k | 1..k-1 accepted)")
    ax.set_ylim(0, 1)
    ax.set_title("Teacher-forced acceptance by position")
    ax.legend(fontsize=8)
    return save_figure(fig, path)
