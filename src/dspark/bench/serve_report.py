"""The `serve` benchmark's report: tables with 95 % intervals, the issue's goals checked, the Pareto plot and the
cost surface the schedulers planned with."""

from __future__ import annotations

from pathlib import Path

from dspark.bench.report import save_figure, section_header
from dspark.bench.serve import SCHEDULED, best_fixed, matched_throughput


def _pm(row: dict, key: str) -> str:
    ci = row.get(key + "_ci")
    return f"{row[key]:.1f}" + ("" if ci is None else f" ± {ci:.1f}")


def _cell(row: dict, key: str, digits: int = 2) -> str:
    return f"{row[key]:.{digits}f}" if key in row else "–"


def _ratio(value: float | None) -> str:
    return "beyond" if value is None else f"{value:.2f}x"


def serve_section(run: dict, command: str, plots: dict[str, str], name: str = "serve") -> str:
    summary = run["summary"]
    levels = sorted({r["concurrency"] for r in summary})
    out = [*section_header(f"## {name}", command, run["when"]), *levels_table(run)]
    lines, verdicts, best_ratio = against_best_fixed(summary, levels)
    out += lines
    lines, matched = matched_table(summary, levels)
    out += lines
    out += ["", "Goals, for the better scheduler:", "", *goal_lines(summary, levels, verdicts, best_ratio, matched)]
    out += [
        "",
        f"![per-user speed against throughput]({plots['pareto']})",
        "",
        f"![the cost the schedulers planned with]({plots['cost']})",
        "",
    ]
    return "\n".join(out)


def levels_table(run: dict) -> list[str]:
    """How the run was made, and one row per policy and level."""
    m, summary = run["machine"], run["summary"]
    reps = max(r["repetitions"] for r in summary)
    out = [
        f"Machine: {m['cpu']}, {m['cores']} cores, flags {', '.join(m['cpu_flags']) or 'n/a'}, torch threads "
        f"{m['torch_threads']}; target {run['model']} in {run['dtype']}, drafter {run['drafter']}. Each level: "
        f"`concurrency` openai clients on loopback, each streaming greedy requests back to back until the level has "
        f"{run['min_requests']} requests or {run['min_tokens']} generated tokens, up to {run['max_tokens']} new "
        f"tokens each, prompts interleaved from {', '.join(run['datasets'])}; {reps} repetition(s), mean ± the "
        "half-width of the 95 % t interval. τ, verified drafts per round, the share of rounds that drafted, "
        "predicted/realised tokens per round, the ECE of the survival estimates and the scheduled rounds' wall time "
        "over what the cost table priced them at come from the server's /metrics over the level.",
        "",
        "| policy | streams | per-user tok/s | aggregate tok/s | TTFT p50 (s) | latency p50 (s) | τ | verified/round "
        "| drafted | predicted/realised | ECE | round time/price |",
        "| --- " * 12 + "|",
    ]
    for r in summary:
        out.append(
            f"| {r['policy']} | {r['concurrency']} | {_pm(r, 'per_user_tps')} | {_pm(r, 'aggregate_tps')} | "
            f"{r['ttft_p50']:.2f} | {r['latency_p50']:.2f} | {_cell(r, 'tau')} | {_cell(r, 'verified_per_round')} | "
            f"{_cell(r, 'drafted_share', 2)} | {_cell(r, 'predicted_over_realised')} | {_cell(r, 'ece', 3)} | "
            f"{_cell(r, 'time_over_price')} |"
        )
    return out


def against_best_fixed(summary: list[dict], levels: list[int]) -> tuple[list[str], dict, dict]:
    """Each scheduler's aggregate throughput over the best fixed policy's per level; with whether it holds within
    the intervals (per scheduler, per level) and its best ratio."""
    out = [
        "",
        "Aggregate throughput of each scheduler against the best of plain decoding and every fixed length at each "
        "level (goal: at least 1.0 within the interval everywhere, at least 1.15 somewhere):",
        "",
        "| streams | best fixed policy (tok/s) | " + " | ".join(SCHEDULED) + " |",
        "| --- " * (2 + len(SCHEDULED)) + "|",
    ]
    verdicts: dict[str, list[bool]] = {s: [] for s in SCHEDULED}
    best_ratio: dict[str, float] = {s: 0.0 for s in SCHEDULED}
    for c in levels:
        base = best_fixed(summary, c)
        cells = []
        for s in SCHEDULED:
            row = next((r for r in summary if r["policy"] == s and r["concurrency"] == c), None)
            if row is None:
                cells.append("–")
                continue
            ratio = row["aggregate_tps"] / base["aggregate_tps"]
            slack = (row.get("aggregate_tps_ci") or 0) + (base.get("aggregate_tps_ci") or 0)
            holds = row["aggregate_tps"] + slack >= base["aggregate_tps"]
            verdicts[s].append(holds)
            best_ratio[s] = max(best_ratio[s], ratio)
            cells.append(f"{ratio:.2f}x" + ("" if holds else " (below)"))
        out.append(f"| {c} | {base['policy']} ({_pm(base, 'aggregate_tps')}) | " + " | ".join(cells) + " |")
    return out, verdicts, best_ratio


def matched_table(summary: list[dict], levels: list[int]) -> tuple[list[str], dict]:
    """Per-user speed at matched throughput against plain and fixed 1, per scheduler and level."""
    out = [
        "",
        "Per-user speed at matched throughput: each scheduler's per-user tokens/s over the baseline's at the same "
        "aggregate tokens/s, interpolated along the baseline's curve through the levels ('beyond': the baseline "
        "never reaches that throughput). Goal at up to 4 streams: 1.6x plain and 1.3x fixed 1.",
        "",
        "| streams | " + " | ".join(f"{s} vs {b}" for s in SCHEDULED for b in ("plain", "fixed 1")) + " |",
        "| --- " * (1 + 2 * len(SCHEDULED)) + "|",
    ]
    matched = {(s, b): matched_throughput(summary, s, b) for s in SCHEDULED for b in ("plain", "fixed 1")}
    for c in levels:
        cells = [_ratio(matched[(s, b)].get(c)) if c in matched[(s, b)] else "–" for s, b in matched]
        out.append(f"| {c} | " + " | ".join(cells) + " |")
    return out, matched


def goal_lines(summary: list[dict], levels: list[int], verdicts: dict, best_ratio: dict, matched: dict) -> list[str]:
    """The benchmark's goals, judged for the scheduler that held at more levels (then the better best ratio)."""
    better = max(SCHEDULED, key=lambda s: (sum(verdicts[s]), best_ratio[s]))
    low = [c for c in levels if c <= 4]

    def meets(baseline: str, bar: float) -> str:
        if not any(r["policy"] == baseline for r in summary):
            return "not measured"
        values = [matched[(better, baseline)].get(c) for c in low]
        return "met" if values and all(v is None or v >= bar for v in values) else "missed"

    plain = {r["concurrency"]: r for r in summary if r["policy"] == "plain"}
    high = []
    for c in (32, 64):
        row = next((r for r in summary if r["policy"] == better and r["concurrency"] == c), None)
        if row and c in plain:
            slack = (row.get("aggregate_tps_ci") or 0) + (plain[c].get("aggregate_tps_ci") or 0)
            high.append(row["aggregate_tps"] + slack >= plain[c]["aggregate_tps"])
    return [
        f"- {better}: at least 1.0x the best fixed policy within the interval at every level: "
        f"{'met' if verdicts[better] and all(verdicts[better]) else 'missed'} "
        f"({sum(verdicts[better])}/{len(verdicts[better])} levels); at least 1.15x at one level: "
        f"{'met' if best_ratio[better] >= 1.15 else 'missed'} (best {best_ratio[better]:.2f}x).",
        f"- matched throughput at up to 4 streams, 1.6x plain: {meets('plain', 1.6)}; "
        f"1.3x fixed 1: {meets('fixed 1', 1.3)}.",
        f"- aggregate throughput not below plain's beyond the interval at 32 and 64 streams: "
        f"{'met' if high and all(high) else 'missed' if high else 'not measured'}.",
    ]


def serve_plots(run: dict, folder: Path, name: str = "serve") -> dict[str, Path]:
    """The Pareto plot (per-user against aggregate tokens/s, one curve per policy through the levels, 95 % interval
    bars) and the cost surface (round time by rows and tokens per row, drafting included)."""
    from dspark.extras import pyplot

    plt = pyplot()
    folder.mkdir(parents=True, exist_ok=True)
    summary = run["summary"]
    fig, ax = plt.subplots(figsize=(8, 5))
    for policy in dict.fromkeys(r["policy"] for r in summary):
        pts = sorted((r for r in summary if r["policy"] == policy), key=lambda r: r["concurrency"])
        style = (
            dict(linewidth=2.5)
            if policy in SCHEDULED
            else dict(linewidth=1, linestyle="--" if policy in ("plain", "fixed 1") else "-")
        )
        ax.errorbar(
            [p["aggregate_tps"] for p in pts],
            [p["per_user_tps"] for p in pts],
            xerr=[p.get("aggregate_tps_ci") or 0 for p in pts],
            yerr=[p.get("per_user_tps_ci") or 0 for p in pts],
            marker="o",
            markersize=3,
            capsize=2,
            label=policy,
            **style,
        )
        for p in pts:
            ax.annotate(
                str(p["concurrency"]),
                (p["aggregate_tps"], p["per_user_tps"]),
                fontsize=6,
                xytext=(2, 2),
                textcoords="offset points",
            )
    ax.set(
        xlabel="aggregate tokens/s (throughput)",
        ylabel="per-user tokens/s",
        title="Per-user speed against throughput (labels: concurrent streams)",
        xscale="log",
        yscale="log",
    )
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7, ncol=2)
    plots = {"pareto": save_figure(fig, folder / f"{name}-pareto.png")}

    grid, draft = run["cost_table"]["grid"], {d["batch_size"]: d["ms"] for d in run["cost_table"]["draft"]}
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for rows in sorted({g["batch_size"] for g in grid}):
        pts = sorted((g["tokens_per_row"], g["ms"] + draft.get(rows, 0.0)) for g in grid if g["batch_size"] == rows)
        ax.plot([w for w, _ in pts], [ms for _, ms in pts], marker="o", label=f"{rows} rows")
    ax.set(
        xlabel="tokens verified per row (anchor + drafts)",
        ylabel="ms per round (drafting + verify)",
        title="Measured round cost by batch shape",
        yscale="log",
    )
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
    plots["cost"] = save_figure(fig, folder / f"{name}-cost.png")
    return plots
