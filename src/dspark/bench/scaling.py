"""`dspark bench scaling`: real-decoding τ of one drafter's successive legs against its cumulative training compute.

Each point is a `dspark bench signal` run, which records the measured drafter's training totals (every leg of its
lineage: README, "Training a drafter"). Per evaluation set, and for their mean, τ − 1 is fitted as a power of the
training tokens (a straight line in log-log); the fit says how many tokens, and at the last leg's throughput how many
core-hours, each set's goal τ would take if the curve kept its slope. The legs differ in more than compute (data,
loss, precision), so the fit reads the history as it happened, not a controlled sweep.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from dspark.bench.report import save_figure, section_header
from dspark.errors import DSparkError


@dataclass
class Point:
    label: str
    tokens: int  # cumulative training tokens of the drafter measured
    core_hours: float | None
    tau: dict[str, float]  # real-decoding τ per evaluation set
    tokens_per_hour: float | None  # throughput of the drafter's last leg, per hour of one core or one GPU
    hour: str  # "core-hour" or "GPU-hour": what the last leg ran on


def read_point(path: Path) -> Point:
    """One bench signal result; it must carry the drafter's training totals and real-decoding rows."""
    try:
        run = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise DSparkError(f"--signal {path}: not a readable `dspark bench signal` JSON ({e})") from e
    totals = run.get("training") if isinstance(run, dict) else None
    if not isinstance(totals, dict) or not totals.get("tokens"):
        raise DSparkError(
            f"--signal {path}: no training totals of its drafter (`dspark bench signal` records them since the "
            "drafter lineage; rerun `dspark bench signal` on that drafter)"
        )
    tau = {r["slice"]: r["real_tau"] for r in run.get("rows", []) if r.get("real_tau") is not None}
    if not tau:
        raise DSparkError(
            f"--signal {path}: no real-decoding rows; run `dspark bench signal` with evaluation --datasets"
        )
    last = totals.get("last_leg") or {}
    rate = None
    if last.get("tokens") and last.get("core_seconds"):  # a GPU leg counts GPU-seconds there
        rate = last["tokens"] / (last["core_seconds"] / 3600)
    hour = "GPU-hour" if str(last.get("device", "")).startswith("cuda") else "core-hour"
    return Point(path.stem, int(totals["tokens"]), totals.get("core_hours"), tau, rate, hour)


def power_fit(tokens: list[float], tau: list[float]) -> tuple[float, float] | None:
    """(a, b) of τ − 1 = a · tokens^b by least squares in log-log; None below two usable points."""
    pts = [(math.log(t), math.log(x - 1)) for t, x in zip(tokens, tau) if t > 0 and x > 1]
    if len(pts) < 2 or len({p[0] for p in pts}) < 2:
        return None
    mx = sum(p[0] for p in pts) / len(pts)
    my = sum(p[1] for p in pts) / len(pts)
    b = sum((x - mx) * (y - my) for x, y in pts) / sum((x - mx) ** 2 for x, _ in pts)
    return math.exp(my - b * mx), b


def scaling_table(points: list[Point], goals: dict[str, float]) -> list[dict]:
    """Per set (and 'mean' over the sets every point has): τ now, the fitted exponent, and the tokens its goal needs
    (goals[set], else goals["*"])."""
    points = sorted(points, key=lambda p: p.tokens)
    sets = [s for s in points[-1].tau if all(s in p.tau for p in points)]
    if not sets:
        raise DSparkError(
            "the --signal runs share no evaluation set; run `dspark bench signal` with the same --datasets"
        )
    series = {s: [p.tau[s] for p in points] for s in sets}
    series["mean"] = [sum(p.tau[s] for s in sets) / len(sets) for p in points]
    tokens = [p.tokens for p in points]
    rate = points[-1].tokens_per_hour
    rows = []
    for name, taus in series.items():
        goal = goals.get(name, goals["*"])
        fit = power_fit(tokens, taus)
        need = None
        if fit and fit[1] > 0:
            need = (((goal - 1) / fit[0]) ** (1 / fit[1])) if taus[-1] < goal else float(tokens[-1])
        rows.append(
            {
                "set": name,
                "goal": goal,
                "tau": [round(t, 3) for t in taus],
                "exponent": None if fit is None else round(fit[1], 3),
                "scale": None if fit is None else fit[0],
                "tokens_for_goal": None if need is None else round(need),
                "times_now": None if need is None else round(need / tokens[-1], 1),
                "hours_more": None if need is None or rate is None else round(max(0.0, need - tokens[-1]) / rate, 2),
                "hour": points[-1].hour,
            }
        )
    return rows


def scaling_section(run: dict, command: str, plot: str, name: str) -> str:
    pts = run["points"]
    legs = ", ".join(
        f"{p['label']} ({p['tokens'] / 1e6:.2f}M tokens"
        + (f", {p['core_hours']:.1f} core-h" if p["core_hours"] is not None else "")
        + ")"
        for p in pts
    )
    rate, hour = pts[-1]["tokens_per_hour"], pts[-1]["hour"]
    out = [
        *section_header(f"## {name}: real τ against cumulative training compute", command, run["when"]),
        f"Points, oldest first: {legs}. Fit: τ − 1 = a · tokens^b per set, least squares in log-log; the last "
        "columns extrapolate it to each set's goal"
        + (f", at the last leg's {rate / 1e6:.2f}M training tokens per {hour}" if rate else "")
        + ". The legs changed data, loss and precision as well as compute: read the fit as the project's history "
        "so far, not as a controlled sweep.",
        "",
        f"| set | real τ by point | exponent b | goal τ | tokens for the goal | × now | {hour}s more |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in run["rows"]:
        need = "–" if r["tokens_for_goal"] is None else f"{r['tokens_for_goal'] / 1e6:,.0f}M"
        taus = " → ".join(f"{t:.2f}" for t in r["tau"])
        exponent = "–" if r["exponent"] is None else f"{r['exponent']:.2f}"
        times = "–" if r["times_now"] is None else f"{r['times_now']:,.0f}×"
        hours = (
            "–"
            if r["hours_more"] is None
            else f"{r['hours_more']:,.2f}"
            if r["hours_more"] < 10
            else f"{r['hours_more']:,.0f}"
        )
        out.append(f"| {r['set']} | {taus} | {exponent} | {r['goal']:g} | {need} | {times} | {hours} |")
    out += ["", f"![real τ against training tokens]({plot})", ""]
    return "\n".join(out)


def scaling_plot(run: dict, path: Path) -> Path:
    """Real τ per set against cumulative training tokens (log x), with each fit drawn out towards the goal."""
    from dspark.extras import pyplot

    plt = pyplot()

    tokens = [p["tokens"] for p in run["points"]]
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    far = max([tokens[-1] * 2] + [r["tokens_for_goal"] for r in run["rows"] if r["tokens_for_goal"]])
    xs = [tokens[0] * (far / tokens[0]) ** (i / 60) for i in range(61)]
    for r in run["rows"]:
        (line,) = ax.plot(tokens, r["tau"], marker="o", linewidth=2.5 if r["set"] == "mean" else 1.2, label=r["set"])
        if r["exponent"] is not None:
            ax.plot(xs, [1 + r["scale"] * x ** r["exponent"] for x in xs], linestyle=":", color=line.get_color())
    for goal in {r["goal"] for r in run["rows"]}:
        ax.axhline(goal, color="grey", linestyle="--", linewidth=1)
    ax.set_xscale("log")
    ax.set_ylim(1, max(max(r["goal"] for r in run["rows"]) + 0.5, max(max(r["tau"]) for r in run["rows"]) + 0.2))
    ax.set_xlabel("cumulative training tokens of the drafter")
    ax.set_ylabel("real-decoding τ (greedy, γ fixed)")
    ax.set_title("Real τ against training compute, with power-law fits (dotted)")
    ax.legend(fontsize=8)
    return save_figure(fig, path)
