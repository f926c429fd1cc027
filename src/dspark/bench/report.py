"""Readable output of a benchmark run: a BENCHMARKS.md section (tables, goals, profile) and PNG plots."""

from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path

from dspark.fsutil import atomic_write_json, atomic_write_text, read_jsonl

PEER_LABELS = {"plain": "dspark plain (reference)", "hf": "HF generate", "hf-lookup": "HF prompt lookup"}
SPEED_GOAL_SETS = ("humaneval", "gsm8k", "mt-bench")


def _mean(xs):
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def _fmt(x, digits=2):
    return "–" if x is None else f"{x:.{digits}f}"


def _by(results, *keys):
    out = defaultdict(list)
    for r in results:
        out[tuple(r[k] for k in keys)].append(r)
    return out


def merged_accept(rows) -> list[float | None]:
    """Acceptance by position over datasets, weighted by rounds (an approximation of the pooled rate)."""
    width = max(len(r["accept_by_position"]) for r in rows)
    out = []
    for k in range(width):
        pairs = [
            (r["accept_by_position"][k], r["rounds"])
            for r in rows
            if k < len(r["accept_by_position"]) and r["accept_by_position"][k] is not None
        ]
        out.append(sum(a * n for a, n in pairs) / sum(n for _, n in pairs) if pairs else None)
    return out


def goals(results: list[dict], drafter_labels: list[str]) -> list[str]:
    """The issue's goals, checked on greedy results: speed against the best peer, τ against the baselines."""
    lines = []
    greedy = [r for r in results if r["temperature"] == 0]
    if "dspark" in drafter_labels:
        for ds in SPEED_GOAL_SETS:
            ours = [r for r in greedy if r["dataset"] == ds and r["method"] in ("dspark", "dspark+sched")]
            peers = [r for r in greedy if r["dataset"] == ds and r["method"] in ("hf", "hf-lookup")]
            if not ours or not peers:
                continue
            best_ours = max(ours, key=lambda r: r["tokens_per_s"])
            best_peer = max(peers, key=lambda r: r["tokens_per_s"])
            ratio = best_ours["tokens_per_s"] / best_peer["tokens_per_s"]
            verdict = "met" if ratio >= 1.5 else f"short by {(1.5 - ratio) / 1.5:.0%}"
            lines.append(
                f"- {ds}: DSpark {best_ours['tokens_per_s']:.1f} tok/s ({best_ours['method']}, {best_ours['dtype']}) vs best peer "
                f"{PEER_LABELS[best_peer['method']]} {best_peer['tokens_per_s']:.1f} tok/s ({best_peer['dtype']}): "
                f"{ratio:.2f}x (goal 1.5x: {verdict})"
            )
        for base, goal in (("dflash", 1.15), ("eagle3", 1.25)):
            if base not in drafter_labels:
                continue
            ours = _mean([r.get("tau") for r in greedy if r["method"] == "dspark"])
            theirs = _mean([r.get("tau") for r in greedy if r["method"] == base])
            if ours and theirs:
                ratio = ours / theirs
                lines.append(
                    f"- τ DSpark / {base} = {ours:.2f} / {theirs:.2f} = {ratio:.2f} (goal ≥ {goal}: "
                    f"{'met' if ratio >= goal else 'not met'})"
                )
    return lines


def drafters_table(drafters: dict) -> list[str]:
    """Each drafter's shape, memory and training, one row per label."""
    out = [
        "Drafters (memory beside the target: own weights, plus the copied rows of the target's LM head when the "
        "draft vocabulary is reduced; embedding and LM head are otherwise shared):",
        "",
        "| label | architecture | γ | layers | Markov rank | params (M) | weights MB | head copy MB | training legs | "
        "train tokens | steps | CPU core-hours | GPU-hours |",
        "| --- " * 13 + "|",
    ]
    for label, d in drafters.items():
        t = d.get("training") or {}  # totals over every leg of the drafter's lineage
        out.append(
            f"| {label} | {d['architecture']} | {d['block_size']} | {d['num_draft_layers']} | {d['markov_rank']} | "
            f"{d['params_millions']} | {d['weights_mb']} | {d['draft_head_copy_mb']} | {t.get('legs') or '–'} | "
            f"{t.get('tokens') or '–'} | {t.get('steps') or '–'} | {t.get('core_hours') or '–'} | "
            f"{t.get('gpu_hours') or '–'} |"
        )
    return out + [""]


def speed_table(
    cell: dict, methods: list[str], datasets: list[str], drafter_labels: list[str], temp: float
) -> list[str]:
    """Tokens/s and speed-up per method and set, τ per set and outputs identical to plain decoding."""
    identical = (
        "identical to plain (float32: must be all)"
        if temp == 0
        else "identical to plain (sampling: not expected; the distribution is what matches)"
    )
    out = [
        "| method | " + " | ".join(f"{d} tok/s (× plain)" for d in datasets) + f" | τ per set | {identical} |",
        "| --- " * (len(datasets) + 3) + "|",
    ]
    for m in methods:
        cells = [
            f"{cell[(m, d)]['tokens_per_s']:.1f} ({cell[(m, d)]['speedup_vs_plain']:.2f}x)" if (m, d) in cell else "–"
            for d in datasets
        ]
        taus = " / ".join(_fmt(cell[(m, d)].get("tau")) for d in datasets if (m, d) in cell)
        same = sum(cell[(m, d)]["identical_to_plain"] for d in datasets if (m, d) in cell)
        total = sum(cell[(m, d)]["prompts"] for d in datasets if (m, d) in cell)
        out.append(
            f"| {PEER_LABELS.get(m, m)} | " + " | ".join(cells) + f" | {taus if m in drafter_labels else '–'} | "
            f"{same}/{total} |"
        )
    return out + [""]


def acceptance_table(cell: dict, spec: list[str], datasets: list[str]) -> list[str]:
    """Acceptance by position and the time of a round's parts, per speculative method over all sets."""
    gamma = max(len(cell[(m, d)]["accept_by_position"]) for m in spec for d in datasets if (m, d) in cell)
    out = [
        "Acceptance by position (P(k accepted | 1..k-1 accepted), all sets) and time per round (draft = "
        "drafter proposal; verify = target forward + acceptance + rollback; context = drafter reading the "
        "accepted tokens' features; other = Python bookkeeping; prefill excluded):",
        "",
        "| drafter | "
        + " | ".join(f"k={k + 1}" for k in range(gamma))
        + " | draft ms | verify ms | context ms | other ms |",
        "| --- " * (gamma + 5) + "|",
    ]
    for m in spec:
        mrows = [cell[(m, d)] for d in datasets if (m, d) in cell]
        acc = merged_accept(mrows) + [None] * gamma
        prof = {k: _mean([r["ms_per_round"][k] for r in mrows]) for k in ("draft", "verify", "context", "other")}
        out.append(
            f"| {m} | "
            + " | ".join(_fmt(a) for a in acc[:gamma])
            + " | "
            + " | ".join(_fmt(prof[k], 1) for k in ("draft", "verify", "context", "other"))
            + " |"
        )
    return out + [""]


def markdown_section(run: dict, name: str, command: str, plot_paths: dict[str, str]) -> str:
    results, cfg, machine = run["results"], run["config"], run["machine"]
    datasets = cfg["datasets"]
    drafter_labels = list(dict.fromkeys([*run["drafters"], *(r["method"] for r in results if "tau" in r)]))
    out = section_header(f"## {name}", command, run["when"])
    out.append(
        f"Machine: {machine['cpu']}, {machine['cores']} cores, torch threads {machine['torch_threads']}, "
        f"flags {', '.join(machine['cpu_flags']) or 'n/a'}, {machine['memory_gb']} GiB; torch {machine['torch']}, "
        f"transformers {machine['transformers']}, dspark {machine['dspark']}. Batch 1, "
        f"{'second turn (after our greedy first answer)' if cfg.get('second_turns') else 'first turn'} of "
        f"{cfg['prompts_per_set']} prompts per set, up to {cfg['max_new_tokens']} new tokens, γ from each drafter."
    )
    out.append("")
    if run["drafters"]:
        out += drafters_table(run["drafters"])
    for (dtype, temp), rows in _by(results, "dtype", "temperature").items():
        mode = "greedy" if temp == 0 else f"temperature {temp}"
        out += [f"### {dtype}, {mode}", ""]
        methods = list(dict.fromkeys(r["method"] for r in rows))
        cell = {(r["method"], r["dataset"]): r for r in rows}
        out += speed_table(cell, methods, datasets, drafter_labels, temp)
        spec = [m for m in methods if m in drafter_labels]
        if spec:
            out += acceptance_table(cell, spec, datasets)
        out += [
            f"Memory: target weights {run['target_weights_mb'][dtype]:.0f} MB; peak RSS of the whole process "
            f"(target, every drafter, Python, caches) {max(r['peak_rss_mb'] for r in rows):.0f} MB.",
            "",
        ]
    g = goals(results, drafter_labels)
    if g:
        out += ["Goals (greedy, batch 1):", ""] + g + [""]
    for title, path in plot_paths.items():
        out.append(f"![{title}]({path})")
    out.append("")
    return "\n".join(out)


def publish_run(run: dict, out: Path, name: str, plot, section, markdown: Path | None) -> list[Path]:
    """Stamp a benchmark run (machine, time; `run["command"]` says how it was made), then write NAME.json, its
    plots (plot() returns a path or a dict of them), NAME.md (the report: tables, plots, machine, command) into
    `out`, and, where `markdown` is given, the same section into that file. Returns what was written."""
    import os
    import time

    from dspark.bench.run import machine_info

    run.update(machine=machine_info(), when=time.strftime("%Y-%m-%d %H:%M:%S %Z"))
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out / f"{name}.json", run)
    pngs = plot()

    def relative(to: Path):
        if pngs is None:  # a report of tables only
            return None
        if isinstance(pngs, dict):
            return {k: os.path.relpath(v, to) for k, v in pngs.items()}
        return os.path.relpath(pngs, to)

    report = out / f"{name}.md"
    atomic_write_text(report, section(run, run["command"], relative(out)) + "\n")
    written = [out / f"{name}.json", report]
    if markdown is not None:
        write_section(markdown, name, section(run, run["command"], relative(markdown.parent)))
        written.append(markdown)
    return written


def section_header(title: str, command: str, when: str | None = None) -> list[str]:
    """The lines every section opens with: its title, when it ran, and the command that reproduces it."""
    run = f"Run {when}. " if when else ""
    return [title, "", f"{run}Reproduce with:", "", "```bash", command, "```", ""]


def write_section(markdown_path: Path, name: str, body: str) -> None:
    """Replace (or append) the section named `name` between its markers, keeping every other section."""
    begin, end = f"<!-- bench:{name}:begin -->", f"<!-- bench:{name}:end -->"
    block = f"{begin}\n{body}\n{end}"
    text = markdown_path.read_text() if markdown_path.exists() else "# Benchmarks\n\nWritten by `dspark bench`.\n"
    pattern = re.compile(re.escape(begin) + ".*?" + re.escape(end), re.S)
    text = pattern.sub(lambda _: block, text) if pattern.search(text) else text.rstrip() + "\n\n" + block + "\n"
    atomic_write_text(markdown_path, text)


def plots(run: dict, folder: Path, prefix: str) -> dict[str, Path]:
    """Acceptance by position, τ per dataset, speed-up per method: one PNG each (greedy, first dtype)."""
    from dspark.extras import pyplot

    plt = pyplot()

    folder.mkdir(parents=True, exist_ok=True)
    results = run["results"]
    dtype = run["config"]["dtypes"][0]
    temp = min(run["config"]["temperatures"])
    rows = [r for r in results if r["dtype"] == dtype and r["temperature"] == temp]
    datasets = run["config"]["datasets"]
    drafters = list(dict.fromkeys(r["method"] for r in rows if "tau" in r))
    paths = {}

    if drafters:
        fig, ax = plt.subplots(figsize=(6, 4))
        for m in drafters:
            acc = merged_accept([r for r in rows if r["method"] == m])
            ax.plot(range(1, len(acc) + 1), [a if a is not None else float("nan") for a in acc], marker="o", label=m)
        ax.set(
            xlabel="draft position k",
            ylabel="P(accept k | 1..k-1 accepted)",
            ylim=(0, 1),
            title=f"Acceptance by position ({dtype}, {'greedy' if temp == 0 else f'T={temp}'})",
        )
        ax.legend()
        paths["acceptance by position"] = save_figure(fig, folder / f"{prefix}-acceptance.png")

        fig, ax = plt.subplots(figsize=(7, 4))
        width = 0.8 / len(drafters)
        for i, m in enumerate(drafters):
            taus = [
                next((r.get("tau") or 0 for r in rows if r["method"] == m and r["dataset"] == d), 0) for d in datasets
            ]
            ax.bar([j + i * width for j in range(len(datasets))], taus, width, label=m)
        ax.set_xticks([j + width * (len(drafters) - 1) / 2 for j in range(len(datasets))], datasets)
        ax.set(ylabel="τ (accepted per round, bonus included)", title="τ per dataset")
        ax.legend()
        paths["tau per dataset"] = save_figure(fig, folder / f"{prefix}-tau.png")

    methods = [m for m in dict.fromkeys(r["method"] for r in rows) if m != "plain"]
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / max(1, len(methods))
    for i, m in enumerate(methods):
        ups = [
            next((r["speedup_vs_plain"] for r in rows if r["method"] == m and r["dataset"] == d), 0) for d in datasets
        ]
        ax.bar([j + i * width for j in range(len(datasets))], ups, width, label=PEER_LABELS.get(m, m))
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([j + width * (len(methods) - 1) / 2 for j in range(len(datasets))], datasets)
    ax.set(ylabel="tokens/s relative to plain decoding", title=f"Speed-up ({dtype}, batch 1)")
    ax.legend(fontsize=8)
    paths["speed-up"] = save_figure(fig, folder / f"{prefix}-speedup.png")
    return paths


def save_figure(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path


def training_curves(runs: dict[str, Path], path: Path) -> dict[str, list[dict]]:
    """Held-out greedy τ against training seconds and tokens, one line per run (from each run's metrics.jsonl), and,
    where a run logged it (`--decode-eval-every`), τ of real decoding against tokens in a third panel."""

    from dspark.extras import pyplot

    plt = pyplot()

    curves, decoded = {}, {}
    for label, folder in runs.items():
        rows = read_jsonl(Path(folder) / "metrics.jsonl")
        curves[label] = [
            {
                "step": r["step"],
                "seconds": r["seconds"],
                "tokens": r["tokens"],
                "tau": r["tau_greedy"],
                "real_tau": r.get("decode_tau_all"),
                "rounds_tau": r.get("tau_rounds"),
            }
            for r in rows
            if "tau_greedy" in r
        ]
        decoded[label] = [(r["tokens"], r["decode_tau_all"]) for r in rows if "decode_tau_all" in r]
    panels = 3 if any(decoded.values()) else 2
    fig, axes = plt.subplots(1, panels, figsize=(5.5 * panels, 4))
    for label, pts in curves.items():
        axes[0].plot([p["seconds"] / 60 for p in pts], [p["tau"] for p in pts], marker=".", label=label)
        axes[1].plot([p["tokens"] / 1e6 for p in pts], [p["tau"] for p in pts], marker=".", label=label)
        if panels == 3 and decoded[label]:
            axes[2].plot(
                [t / 1e6 for t, _ in decoded[label]], [tau for _, tau in decoded[label]], marker=".", label=label
            )
    axes[0].set(
        xlabel="training wall time (minutes)", ylabel="held-out τ (greedy, teacher-forced)", title="τ against time"
    )
    axes[1].set(
        xlabel="training tokens seen (millions)", ylabel="held-out τ (greedy, teacher-forced)", title="τ against tokens"
    )
    if panels == 3:
        axes[2].set(
            xlabel="training tokens seen (millions)",
            ylabel="τ of real greedy decoding (evaluation slice)",
            title="real decoding against tokens",
        )
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend()
    save_figure(fig, path)
    return curves


def curve_at(points: list[dict], key: str, value: float) -> float | None:
    """τ interpolated at `value` of seconds or tokens (None beyond the run)."""
    for a, b in zip(points, points[1:]):
        if a[key] <= value <= b[key]:
            w = (value - a[key]) / (b[key] - a[key]) if b[key] > a[key] else 0.0
            return a["tau"] + w * (b["tau"] - a["tau"])
    return points[-1]["tau"] if points and abs(points[-1][key] - value) < 1e-9 else None


def curves_table(
    curves: dict[str, list[dict]],
    reference: str,
    command: str,
    plot: str,
    tokens: float | None = None,
    seconds: float | None = None,
    title: str = "Training curves: drafters trained alike",
) -> str:
    """Markdown: every run's held-out τ at the same training tokens and at the same wall time (by default the
    furthest point all runs reached), beside the reference run's (the paper's 'trained alike' comparison)."""
    runs = {label: pts for label, pts in curves.items() if pts}
    tokens = tokens or min(pts[-1]["tokens"] for pts in runs.values())
    seconds = seconds or min(pts[-1]["seconds"] for pts in runs.values())
    at = {label: (curve_at(pts, "tokens", tokens), curve_at(pts, "seconds", seconds)) for label, pts in runs.items()}
    ref_tok, ref_sec = at[reference]
    fmt = lambda x: "–" if x is None else f"{x:.3f}"
    ratio = lambda a, b: "–" if a is None or b is None else f"{a / b:.3f}"
    out = [
        *section_header(f"## {title}", command),
        "Held-out τ (greedy, teacher-forced over γ, bonus included) on the same held-out slice of the training data",
        "(along the rounds: at the anchors greedy decoding of those prompts visits, where the run logged it),",
        f"read at {tokens:,.0f} training tokens and at {seconds / 60:.1f} minutes of training (linear between "
        "evaluations; – where a run has no evaluation around that point).",
        "",
        f"| run | steps | τ at {tokens / 1e3:.0f}k tokens | {reference} ÷ run | τ at {seconds / 60:.0f} min | "
        f"{reference} ÷ run | final τ (step, minutes) | final τ along the rounds | last real-decoding τ (step) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for label, pts in runs.items():
        tok, sec = at[label]
        last = pts[-1]
        real = [p for p in pts if p.get("real_tau") is not None]  # runs with --decode-eval-every
        real_cell = f"{real[-1]['real_tau']:.3f} ({real[-1]['step']})" if real else "–"
        out.append(
            f"| {label} | {last['step']} | {fmt(tok)} | {ratio(ref_tok, tok)} | {fmt(sec)} | {ratio(ref_sec, sec)} | "
            f"{last['tau']:.3f} ({last['step']}, {last['seconds'] / 60:.0f}) | {fmt(last.get('rounds_tau'))} | "
            f"{real_cell} |"
        )
    out += ["", f"![training curves]({plot})", ""]
    return "\n".join(out)


def engine_section(run: dict, command: str, plot: str, name: str = "engine") -> str:
    """The `engine` section of BENCHMARKS.md: forward cost per engine against the bandwidth bound, then decoding speed."""
    m = run["machine"]
    out = [
        *section_header(f"## {name}", command, run["when"]),
        f"Machine: {m['cpu']}, {m['cores']} cores, torch threads {m['torch_threads']}, flags "
        f"{', '.join(m['cpu_flags']) or 'n/a'}; torch {m['torch']}. Matrix-vector bandwidth measured here: "
        f"{run['bandwidth_gbs']} GB/s; the bound is the weight bytes one step reads divided by it.",
    ]
    if run["llama_cpp"]:
        lc = run["llama_cpp"]
        out.append(
            f"llama.cpp: llama-cpp-python {lc['version']} built on this machine, {lc['file']} (4-bit weights, so "
            f"not the same arithmetic), {lc['threads']} threads, weight repacking off; it decodes through its own "
            "completion loop (`create_completion`, the last token's logits only), measured beside each of our rows."
        )
    counts = sorted({int(n) for r in run["forward"] for n in r["ms"]})
    out += [
        "",
        "Milliseconds per forward of n new tokens on a 256-token cache (logits of every new token; ours and HF "
        "also return the drafter's features):",
        "",
        "| precision | engine | " + " | ".join(f"n={n}" for n in counts) + " | n=8 ÷ n=1 |",
        "| --- " * (len(counts) + 3) + "|",
    ]
    for r in run["forward"]:
        ms = r["ms"]
        ratio = f"{ms['8'] / ms['1']:.2f}" if "8" in ms and "1" in ms else "–"
        out.append(
            f"| {r['dtype']} | {r['engine']} | " + " | ".join(_fmt(ms.get(str(n)), 1) for n in counts) + f" | {ratio} |"
        )
    engines = [
        k
        for k in dict.fromkeys(k for r in run["decode"] for k in r)
        if k not in ("dtype", "dataset", "same as float32") and not k.endswith(("tau", "identical"))
    ]
    out += [
        "",
        "Tokens/s, batch 1, greedy, first prompt of each set (dspark: the shipped drafter alone, suffix: suffix "
        "decoding alone, dspark+suffix: both, the default; at a fixed γ and +sched under the confidence scheduler; "
        "τ and whether the output is identical to our plain decoding in brackets; llama.cpp lookup: "
        "llama-cpp-python's prompt-lookup speculation, against its plain output; last column: tokens our plain "
        "output shares with float32's before the first difference):",
        "",
        "| precision | set | " + " | ".join(engines) + " | same as float32 |",
        "| --- " * (len(engines) + 3) + "|",
    ]
    for r in run["decode"]:
        cells = []
        for e in engines:
            cell = f"{r[e]:.1f}" if e in r else "–"
            if f"{e} tau" in r:
                cell += f" (τ {r[e + ' tau']}, {'same' if r[e + ' identical'] else 'differs'})"
            elif f"{e} identical" in r:  # llama.cpp's speculation, against its own plain output
                cell += f" ({'same' if r[e + ' identical'] else 'differs'})"
            cells.append(cell)
        out.append(f"| {r['dtype']} | {r['dataset']} | " + " | ".join(cells) + f" | {r.get('same as float32', '–')} |")
    out += ["", f"![forward cost]({plot})", ""]
    return "\n".join(out)


def engine_plot(run: dict, path: Path) -> Path:
    from dspark.extras import pyplot

    plt = pyplot()

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in run["forward"]:
        label = f"{r['engine']} ({r['dtype']})"
        if r["engine"] == "bandwidth bound":
            ax.axhline(r["ms"]["1"], linestyle="--", linewidth=1, color="grey")
            ax.text(1, r["ms"]["1"], " " + label, va="bottom", fontsize=7, color="grey")
            continue
        xs = sorted(int(n) for n in r["ms"])
        ax.plot(xs, [r["ms"][str(n)] for n in xs], marker="o", label=label)
    ax.set(
        xscale="log",
        xlabel="new tokens per forward",
        ylabel="ms per forward",
        ylim=(0, None),
        title="What a verify costs: forward time against tokens",
    )
    ax.set_xticks([1, 2, 4, 8, 16], ["1", "2", "4", "8", "16"])
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    path.parent.mkdir(parents=True, exist_ok=True)
    return save_figure(fig, path)


def _llama_cells(run: dict, dataset: str | None, runtime: str, method: str) -> tuple[float | None, float | None]:
    """Mean tokens/s and τ of one runtime's method on one set (all sets when `dataset` is None)."""
    cells = [r["runtimes"][runtime][method] for r in run["rows"] if dataset in (None, r["dataset"])]
    return _mean([c["tok_s"] for c in cells]), _mean([c.get("tau") for c in cells])


def llama_cpp_section(run: dict, command: str, plot: str) -> str:
    """The `llama-cpp` section: per runtime (llama.cpp on each weights, our engine) tokens/s and τ per evaluation set,
    our draft's acceptance in both runtimes side by side, and output identity."""
    m, rows = run["machine"], run["rows"]
    runtimes = list(rows[0]["runtimes"])
    llama = [r for r in runtimes if r.startswith("llama.cpp")]
    weights = ", ".join(f"{w}: `{f}`" for w, f in run["target_ggufs"].items())
    out = [
        *section_header("## llama-cpp", command, run["when"]),
        f"Machine: {m['cpu']}, {m['cores']} cores, {run['threads']} threads for llama.cpp, torch threads "
        f"{m['torch_threads']}. llama.cpp {run['llama_cpp_version']} (`{run['llama_bin']}`) on the target's "
        f"GGUF ({weights}; the float32 copy is the shipped file dequantized, the weights our float32 target uses), "
        f"with our drafter exported by `dspark export --format gguf` (`--spec-type draft-dspark "
        f"--spec-draft-n-max {run['gamma']}`; fixed length: `--spec-draft-p-min 0`); n-gram: `--spec-type "
        f"ngram-simple`. Ours: {run['model']} in {run['dtype']}, drafter {run['drafter']}. Greedy, up to "
        f"{run['max_new_tokens']} new tokens, {run['prompts_per_set']} prompt(s) per set.",
        "",
    ]
    for runtime in runtimes:
        methods = list(rows[0]["runtimes"][runtime])
        out += [
            f"{runtime}: tokens/s (τ = tokens per target verification)",
            "",
            "| set | " + " | ".join(methods) + " | best speculative / plain |",
            "| --- " * (len(methods) + 2) + "|",
        ]
        for name in [*run["datasets"], None]:
            cells = [_llama_cells(run, name, runtime, method) for method in methods]
            best = max(speed for speed, _ in cells[1:]) / cells[0][0]
            out.append(
                f"| {name or '**all**'} | "
                + " | ".join(_fmt(speed) + (f" (τ {_fmt(tau)})" if tau is not None else "") for speed, tau in cells)
                + f" | {_fmt(best)}x |"
            )
        out.append("")
    ours = next(r for r in runtimes if r.startswith("ours"))
    out += [
        "Our drafter at a fixed draft length, τ in each runtime (the float32 llama.cpp run verifies with our "
        "arithmetic, so its τ should match ours up to ties):",
        "",
        "| set | " + " | ".join([ours, *llama]) + " |",
        "| --- " * (len(llama) + 2) + "|",
    ]
    for name in [*run["datasets"], None]:
        out.append(
            f"| {name or '**all**'} | "
            + " | ".join(_fmt(_llama_cells(run, name, r, "dspark")[1]) for r in [ours, *llama])
            + " |"
        )
    same = {
        f"{r} {m}": all(row["runtimes"][r][m]["identical"] for row in rows)
        for r in runtimes
        for m in rows[0]["runtimes"][r]
        if "identical" in rows[0]["runtimes"][r][m]
    }
    agree = {r: sum(row["runtimes"][r]["plain"]["same_as_ours"] for row in rows) for r in llama}
    out += [
        "",
        "Greedy output identical to the same runtime's plain decoding on every prompt: "
        + ", ".join(f"{c}: {'yes' if ok else 'NO'}" for c, ok in same.items())
        + ".",
        "llama.cpp's plain output equal to ours: "
        + ", ".join(f"{r}: {n} of {len(rows)} prompts" for r, n in agree.items())
        + ".",
        "",
        f"![tokens/s per method]({plot})",
        "",
    ]
    return "\n".join(out)


def llama_cpp_plot(run: dict, path: Path) -> Path:
    from dspark.extras import pyplot

    plt = pyplot()

    runtimes = list(run["rows"][0]["runtimes"])
    fig, axes = plt.subplots(1, len(runtimes), figsize=(4 * len(runtimes), 3.6), sharey=True, squeeze=False)
    for ax, runtime in zip(axes[0], runtimes):
        methods = list(run["rows"][0]["runtimes"][runtime])
        width = 0.8 / len(methods)
        for i, method in enumerate(methods):
            speeds = [_llama_cells(run, name, runtime, method)[0] for name in run["datasets"]]
            ax.bar([x + i * width for x in range(len(run["datasets"]))], speeds, width, label=method)
        ax.set_xticks([x + 0.4 - width / 2 for x in range(len(run["datasets"]))], run["datasets"], fontsize=7)
        ax.set_title(runtime, fontsize=9)
        ax.legend(fontsize=6)
    axes[0][0].set_ylabel("tokens/s")
    return save_figure(fig, path)


def quality_section(run: dict, command: str, plot: str, name: str = "quality") -> str:
    """The `quality` section of BENCHMARKS.md: each precision's closeness to float32, overall and per set."""
    from dspark.bench.quality import COMPILED_HEAD, overall

    m = run["machine"]
    lc = run["llama_cpp"]
    llama = f" llama.cpp: llama-cpp-python {lc['version']} on {lc['file']}." if lc else ""
    if lc and lc.get("same_weights"):
        llama += (
            " The target's float weights are that file's, dequantized: llama.cpp runs the float32 model's weights "
            "with arithmetic of its own (8-bit activations in its products), while int8 rounds them once more, "
            "onto a grid per output channel."
        )
    if any(r["precision"] == COMPILED_HEAD for r in run["rows"]):
        llama += (
            f" {COMPILED_HEAD}: int4 with the LM head a compiled target (`--compile`) runs, every token scored in 4 "
            "bits and the best 64 scored again exactly."
        )
    out = [
        *section_header(f"## {name}", command, run["when"]),
        f"Machine: {m['cpu']}, torch {m['torch']}, torch threads {m['torch_threads']}.{llama} Target "
        f"{run['model']}; the float32 model answers {run['prompts_per_set']} prompts of each set greedily (up to "
        f"{run['max_new_tokens']} new tokens); every other model is read on those answers (teacher-forced: how "
        "often its most likely next token is float32's, KL(float32 ‖ it) in nats per token, perplexity of the "
        "answers), then answers the same prompts itself (identical answers, mean tokens shared before the first "
        "difference).",
        "",
        "| precision | tokens | top-1 agreement | KL (nats/token) | perplexity | identical answers | tokens shared |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in overall(run):
        out.append(
            f"| {r['precision']} | {r['tokens']} | {r['top1_agreement']:.1%} | {r['kl']:.4f} | "
            f"{r['perplexity']:.3f} | {r['identical']}/{r['prompts']} | {r['shared_prefix']:.1f} |"
        )
    labels = list(dict.fromkeys(r["precision"] for r in run["rows"]))
    sets = list(dict.fromkeys(r["dataset"] for r in run["rows"]))
    cell = {(r["precision"], r["dataset"]): r for r in run["rows"]}
    out += [
        "",
        "Top-1 agreement with float32 per set (identical answers in brackets):",
        "",
        "| precision | " + " | ".join(sets) + " |",
        "| --- " * (len(sets) + 1) + "|",
    ]
    for label in labels:
        cells = [cell[(label, s)] for s in sets]
        out.append(
            f"| {label} | "
            + " | ".join(f"{c['top1_agreement']:.1%} ({c['identical']}/{c['prompts']})" for c in cells)
            + " |"
        )
    out += ["", f"![closeness to float32]({plot})", ""]
    return "\n".join(out)


def quality_plot(run: dict, path: Path) -> Path:
    from dspark.bench.quality import overall
    from dspark.extras import pyplot

    plt = pyplot()
    rows = overall(run)
    labels = [r["precision"] for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.8))
    left.bar(labels, [100 * r["top1_agreement"] for r in rows], color="tab:blue")
    left.set(ylabel="top-1 agreement with float32 (%)", ylim=(min(100 * r["top1_agreement"] for r in rows) - 5, 100))
    right.bar(labels, [r["kl"] for r in rows], color="tab:orange")
    right.set(ylabel="KL(float32 ‖ model), nats/token")
    for ax in (left, right):
        ax.tick_params(axis="x", labelsize=8, rotation=15)
        ax.grid(alpha=0.3, axis="y")
    fig.suptitle("How close each precision stays to the float32 model")
    path.parent.mkdir(parents=True, exist_ok=True)
    return save_figure(fig, path)
