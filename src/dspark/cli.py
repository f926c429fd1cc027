"""The `dspark` command. The only module that reads command-line arguments; each subcommand calls the library."""

from __future__ import annotations

import argparse
import json
import sys

from dspark.errors import DSparkError


# ---- shared argument groups ------------------------------------------------------------------------------------
def add_target_args(p: argparse.ArgumentParser) -> None:
    from dspark.models import DEFAULT_TARGET

    p.add_argument("--model", default=DEFAULT_TARGET, help=f"known target name or HF model folder (default {DEFAULT_TARGET})")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="target precision")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch's default)")


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--top-p", type=float, default=1.0, help="1 = off")
    p.add_argument("--seed", type=int, default=None)


def sampling_from(args):
    from dspark.decoding.sampling import SamplingParams

    return SamplingParams(args.temperature, args.top_k, args.top_p, args.seed)


def positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def default_eval_dir():
    from pathlib import Path

    return Path(__file__).parent / "data" / "eval"


def setup_torch(args) -> None:
    import torch

    if getattr(args, "threads", 0):
        torch.set_num_threads(args.threads)


def load_target(args, layer_ids=None):
    from dspark.target import Target

    setup_torch(args)
    return Target.load(args.model, dtype=args.dtype, layer_ids=layer_ids)


def build_policy(args, target=None, drafter_path=None):
    from dspark.decoding.policy import ConfidenceThreshold, FixedLength, PrefixScheduler

    if getattr(args, "schedule", False):
        from dspark.scheduling.profile import machine_scheduler

        return machine_scheduler(target, drafter_path)
    if getattr(args, "cost_table", None):
        from dspark.scheduling.calibration import read_temperatures
        from dspark.scheduling.profile import CostTable

        temps = read_temperatures(args.calibration) if getattr(args, "calibration", None) else None
        return PrefixScheduler(CostTable.load(args.cost_table), temps)
    if getattr(args, "confidence_threshold", None) is not None:
        return ConfidenceThreshold(args.confidence_threshold)
    return FixedLength(getattr(args, "verify_length", None))


def add_policy_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--verify-length", type=int, default=None, help="verify this many draft tokens per round (default γ)")
    p.add_argument("--confidence-threshold", type=float, default=None, help="verify up to the first c_k below this")
    p.add_argument("--schedule", action="store_true",
                   help="confidence-scheduled verification with this machine's cost table (profiled once, cached) "
                        "and the drafter's shipped calibration")
    p.add_argument("--cost-table", help="cost table JSON (`dspark profile`): schedule verification lengths (Algorithm 1)")
    p.add_argument("--calibration", help="STS temperatures JSON (`dspark calibrate`) for the scheduler")


class TextStream:
    """Prints a growing token sequence as text, decoding the whole sequence so multi-byte characters come out whole."""

    def __init__(self, tokenizer, out=sys.stdout):
        self.tokenizer, self.out, self.tokens, self.shown = tokenizer, out, [], ""

    def __call__(self, _request: int, tokens: list[int]) -> None:
        self.tokens.extend(tokens)
        text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        if text.startswith(self.shown) and not text.endswith("\ufffd"):
            self.out.write(text[len(self.shown):])
            self.out.flush()
            self.shown = text


# ---- subcommands -----------------------------------------------------------------------------------------------
def cmd_models(args) -> int:
    from dspark.models import list_targets

    rows = list_targets()
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    for r in rows:
        state = "provisioned" if r["provisioned"] else ("package installed" if r["package_installed"] else "package missing")
        print(f"{r['name']:<24} {state:<18} {r['description']}")
        print(f"{'':<24} from {r['package']} -> {r['path']}")
    return 0


def cmd_generate(args) -> int:
    from dspark.decoding.plain import generate_plain

    if not args.prompt.strip():
        raise DSparkError("the prompt is empty; give the model something to answer")
    target = load_target(args)
    prompt = target.encode_chat(args.prompt)
    sampling = sampling_from(args)
    stream = None if args.json else TextStream(target.tokenizer)

    engine = None
    if args.drafter:
        from dspark.decoding.engine import SpeculativeEngine
        from dspark.drafter import DSparkDrafter

        engine = SpeculativeEngine(target, DSparkDrafter.load(args.drafter, target), build_policy(args, target, args.drafter))
        result = engine.generate([prompt], args.max_new_tokens, sampling, on_tokens=stream)[0]
    else:
        result = generate_plain(target, [prompt], args.max_new_tokens, sampling, on_tokens=stream)[0]

    report = {
        "text": target.tokenizer.decode(result.token_ids, skip_special_tokens=True),
        "token_ids": result.token_ids,
        "new_tokens": len(result.token_ids),
        "finish_reason": result.finish_reason,
        "seconds": round(result.seconds, 4),
        "tokens_per_s": round(result.tokens_per_s, 3),
        "dtype": args.dtype,
    }
    if result.stats is not None:
        s = result.stats.to_dict()
        report.update(tau=s["tau"], accept_by_position=s["accept_by_position"], rounds=s["rounds"], spec_stats=s)
    if args.compare_plain:
        if engine is None:
            raise DSparkError("--compare-plain compares speculative decoding with plain decoding; add --drafter PATH")
        plain = generate_plain(target, [prompt], args.max_new_tokens, sampling)[0]
        report.update(
            plain_tokens_per_s=round(plain.tokens_per_s, 3),
            speedup=round(result.tokens_per_s / plain.tokens_per_s, 3) if plain.tokens_per_s else None,
            identical_to_plain=plain.token_ids == result.token_ids,
        )
    if args.json:
        print(json.dumps(report, ensure_ascii=False))
        return 0
    print()
    line = f"[{report['new_tokens']} tokens, {report['seconds']:.2f} s, {report['tokens_per_s']:.1f} tokens/s"
    if "tau" in report:
        line += f", τ={report['tau']:.2f} over {report['rounds']} rounds"
    if "speedup" in report:
        line += f"; plain {report['plain_tokens_per_s']:.1f} tokens/s, speed-up {report['speedup']:.2f}x, "
        line += "identical output" if report["identical_to_plain"] else "OUTPUT DIFFERS from plain decoding"
    print(line + "]", file=sys.stderr)
    return 0


def cmd_demo(args) -> int:
    import textwrap

    from dspark.bench.demo import run_demo, shipped_drafter
    from dspark.drafter import DSparkDrafter

    from dspark.decoding.policy import FixedLength
    from dspark.scheduling.profile import machine_scheduler

    target = load_target(args)
    drafter_path = args.drafter or shipped_drafter(args.model)
    drafter = DSparkDrafter.load(drafter_path, target)
    policy = FixedLength()
    if drafter.confidence_head is not None and not args.fixed:
        policy = machine_scheduler(target, drafter_path)
    print(f"target {args.model} ({args.dtype}), drafter {drafter_path}, greedy, γ={drafter.block_size}, "
          f"verification: {policy.describe()}, max {args.max_new_tokens} new tokens\n")
    rows = run_demo(target, drafter, args.datasets, args.per_set, args.max_new_tokens, policy)
    for r in rows:
        print(f"=== {r.dataset}: {textwrap.shorten(r.prompt, 100)}")
        print(f"--- DSpark (τ={r.tau:.2f}, {r.spec_tokens_per_s:.1f} tok/s) vs plain ({r.plain_tokens_per_s:.1f} tok/s): "
              f"speed-up {r.speedup:.2f}x, outputs {'IDENTICAL' if r.identical else 'DIFFER'}")
        print(r.spec_text.strip())
        if not r.identical:
            print("--- plain decoding gave:")
            print(r.plain_text.strip())
        print()
    total_plain = sum(1 / r.plain_tokens_per_s for r in rows)
    total_spec = sum(1 / r.spec_tokens_per_s for r in rows)
    print(f"mean τ {sum(r.tau for r in rows) / len(rows):.2f}; speed-up {total_plain / total_spec:.2f}x "
          f"(harmonic over prompts); identical outputs: {sum(r.identical for r in rows)}/{len(rows)}")
    return 0 if all(r.identical for r in rows) or args.dtype != "float32" else 1


def cmd_bench(args) -> int:
    import os
    import shlex
    from pathlib import Path

    from dspark.bench.demo import shipped_drafter
    from dspark.bench.report import markdown_section, plots, write_section
    from dspark.bench.run import BenchConfig, run_bench
    from dspark.fsutil import atomic_write_json

    setup_torch(args)
    drafters = {}
    for item in args.drafter or [f"dspark={shipped_drafter(args.model)}"]:
        label, sep, path = item.partition("=")
        if not sep or not label or not path:
            raise DSparkError(f"--drafter takes LABEL=PATH (e.g. dspark=runs/drafter/checkpoint), got '{item}'")
        drafters[label] = path
    cfg = BenchConfig(model=args.model, datasets=args.datasets, prompts_per_set=args.prompts_per_set,
                      max_new_tokens=args.max_new_tokens, temperatures=args.temperatures, dtypes=args.dtypes,
                      drafters=drafters, peers=args.peers, seed=args.seed, scheduled=args.scheduled)
    run = run_bench(cfg, progress=lambda line: print(line, file=sys.stderr))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = f"OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']} " if "OMP_NUM_THREADS" in os.environ else ""
    command = env + "dspark " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    run["command"] = command
    atomic_write_json(out / f"{args.name}.json", run)
    markdown = Path(args.markdown)
    pngs = plots(run, out, args.name)
    rel = {k: os.path.relpath(v, markdown.parent) for k, v in pngs.items()}
    write_section(markdown, args.name, markdown_section(run, args.name, command, rel))
    print(f"dspark: wrote {out / (args.name + '.json')}, {len(pngs)} plots and section '{args.name}' of {markdown}",
          file=sys.stderr)
    return 0


def cmd_bench_train(args) -> int:
    import shlex
    from pathlib import Path

    from dspark.bench.report import write_section
    from dspark.bench.training import levers_markdown, time_levers
    from dspark.fsutil import atomic_write_json

    setup_torch(args)
    base = dict(markov_rank=args.markov_rank, num_anchors=64, target_dtype="bfloat16")
    rows = time_levers(args.data, args.model, base, steps=args.steps, batch_size=args.batch_size)
    command = "dspark " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    Path(args.out).mkdir(parents=True, exist_ok=True)
    atomic_write_json(Path(args.out) / "training-levers.json", {"command": command, "rows": rows})
    write_section(Path(args.markdown), "training-levers", levers_markdown(rows, command))
    for r in rows:
        print(json.dumps(r))
    return 0


def cmd_export(args) -> int:
    from dspark.drafter import DSparkDrafter
    from dspark.drafter.model import read_checkpoint_meta
    from dspark.target import parse_dtype

    meta = read_checkpoint_meta(args.checkpoint)
    target = load_target(args)
    drafter = DSparkDrafter.load(args.checkpoint, target)
    extra = {k: v for k, v in meta.items() if k in ("training", "progress")}
    drafter.save(args.out, target.identity(), extra=extra, dtype=parse_dtype(args.dtype))
    print(f"dspark: wrote {args.out} ({args.dtype})", file=sys.stderr)
    return 0


def cmd_profile(args) -> int:
    from dspark.scheduling.profile import profile_target

    target = load_target(args)
    table = profile_target(target, tuple(args.token_counts), args.context, args.repeats)
    table.save(args.out)
    for n, t in zip(table.token_counts, table.step_time_ms):
        print(f"{n:>4} tokens  {t:8.2f} ms  ({t / table.step_time_ms[0]:.2f}x one token)")
    print(f"dspark: wrote {args.out}", file=sys.stderr)
    return 0


def cmd_calibrate(args) -> int:
    import torch

    from dspark.bench.demo import eval_prompts
    from dspark.decoding.engine import SpeculativeEngine
    from dspark.drafter import DSparkDrafter
    from dspark.fsutil import atomic_write_json
    from dspark.scheduling.calibration import Rounds, fit_sts, reliability_plot, report
    from dspark.training.data import read_records

    target = load_target(args)
    drafter = DSparkDrafter.load(args.drafter, target)
    if drafter.confidence_head is None:
        raise DSparkError(f"{args.drafter} has no confidence head to calibrate")
    if args.data:
        texts = [next(m["content"] for m in r["messages"] if m["role"] == "user") for r in read_records(args.data)]
    else:
        texts = [t for name in args.datasets for t in eval_prompts(name, args.limit)]
    texts = texts[: args.limit * max(1, len(args.datasets) if not args.data else 1)]
    logits, accepted, verified = [], [], []
    engine = SpeculativeEngine(target, drafter)  # fixed γ: every position is observed
    engine.generate([target.encode_chat(t) for t in texts], args.max_new_tokens,
                    on_round=lambda r, c, ell, acc: (logits.append(c.float()), accepted.append(acc), verified.append(ell)))
    gamma = drafter.block_size
    k = torch.arange(gamma)
    rounds = Rounds(torch.stack(logits), torch.tensor(accepted)[:, None] > k, torch.tensor(verified)[:, None] > k)
    temps = fit_sts(rounds)
    rows = report(rounds, temps)
    atomic_write_json(args.out, {"sts_temperatures": temps, "rounds": len(logits), "report": rows,
                                 "drafter": str(args.drafter), "prompts": len(texts)})
    if args.plot:
        reliability_plot(rounds, temps, args.plot)
    for r in rows:
        print(json.dumps(r))
    print(f"dspark: {len(logits)} rounds; STS temperatures {temps}; wrote {args.out}", file=sys.stderr)
    return 0


def cmd_curves(args) -> int:
    import os
    import shlex
    from pathlib import Path

    from dspark.bench.report import curves_table, training_curves, write_section

    runs = {}
    for item in args.run:
        label, sep, path = item.partition("=")
        if not sep or not (Path(path) / "metrics.jsonl").exists():
            raise DSparkError(f"--run takes LABEL=RUN_FOLDER with a metrics.jsonl, got '{item}'")
        runs[label] = Path(path)
    reference = args.reference or next(iter(runs))
    if reference not in runs:
        raise DSparkError(f"--reference '{reference}' is not one of the --run labels ({', '.join(runs)})")
    curves = training_curves(runs, Path(args.out))
    if not all(curves.values()):
        raise DSparkError(f"runs without a held-out evaluation yet: {', '.join(k for k, v in curves.items() if not v)}")
    markdown = Path(args.markdown) if args.markdown else None
    plot = os.path.relpath(args.out, markdown.parent) if markdown else str(args.out)
    table = curves_table(curves, reference, "dspark " + shlex.join(sys.argv[1:]), plot, args.at_tokens,
                         args.at_minutes * 60 if args.at_minutes else None)
    print(table)
    if markdown:
        write_section(markdown, "training-curves", table)
        print(f"dspark: wrote {args.out} and the training-curves section of {markdown}", file=sys.stderr)
    return 0


def cmd_prompts(args) -> int:
    from dspark.fsutil import atomic_write_json, atomic_write_text
    from dspark.training.sources import build_prompts

    records, report = build_prompts(args.count, args.seed, args.eval_dir)
    atomic_write_text(args.out, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
    atomic_write_json(str(args.out) + ".report.json", report)
    print(json.dumps(report))
    return 0


def cmd_regenerate(args) -> int:
    from dspark.training.data import read_records
    from dspark.training.regenerate import regenerate

    records = read_records(args.prompts)
    if args.limit:
        records = records[: args.limit]
    target = load_target(args)
    report = regenerate(target, records, args.out, args.max_new_tokens, args.batch_size, sampling_from(args))
    print(json.dumps(report))
    return 0


def cmd_train(args) -> int:
    from dataclasses import fields

    from dspark.training.trainer import TrainConfig, train

    setup_torch(args)
    if args.resume:
        from pathlib import Path

        saved = Path(args.out) / "checkpoint" / "trainer_state.json"
        if not saved.exists():
            raise DSparkError(f"--resume: {saved} does not exist; start the run without --resume")
        cfg = TrainConfig.from_dict(json.loads(saved.read_text())["train_config"])
    else:
        if not args.data:
            raise DSparkError("--data is required (regenerated JSONL from `dspark regenerate`)")
        given = {f.name: getattr(args, f.name) for f in fields(TrainConfig) if getattr(args, f.name, None) is not None}
        cfg = TrainConfig(**given)
    result = train(cfg, resume=args.resume, progress=not args.quiet)
    print(json.dumps(result))
    return 0


# ---- parser ----------------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dspark", description=__import__("dspark").__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("models", help="list known targets and whether each is provisioned")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_models)

    p = sub.add_parser("generate", help="answer one chat prompt, streaming text, plain or speculative")
    p.add_argument("prompt")
    add_target_args(p)
    add_sampling_args(p)
    p.add_argument("--max-new-tokens", type=positive_int, default=256)
    p.add_argument("--drafter", help="drafter checkpoint folder: decode speculatively")
    add_policy_args(p)
    p.add_argument("--compare-plain", action="store_true", help="also run plain decoding; report speed-up and identity")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("demo", help="plain vs DSpark side by side with the shipped drafter")
    add_target_args(p)
    p.add_argument("--drafter", help="drafter checkpoint (default: the one shipped for --model)")
    p.add_argument("--datasets", nargs="+", default=["humaneval", "gsm8k", "mt-bench"])
    p.add_argument("--per-set", type=positive_int, default=1)
    p.add_argument("--max-new-tokens", type=positive_int, default=128)
    p.add_argument("--fixed", action="store_true", help="verify all γ draft tokens every round (no scheduler)")
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("bench", help="τ, speed, agreement and memory of every method, side by side")
    p.add_argument("--model", default=__import__("dspark.models", fromlist=["x"]).DEFAULT_TARGET)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--datasets", nargs="+", default=["humaneval", "gsm8k", "mt-bench", "mbpp", "math500"],
                   help="evaluation set names or JSONL paths of {\"turns\": [...]} records")
    p.add_argument("--prompts-per-set", type=positive_int, default=3)
    p.add_argument("--max-new-tokens", type=positive_int, default=128)
    p.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    p.add_argument("--drafter", action="append", help="LABEL=PATH, repeatable (default: dspark=<shipped drafter>)")
    p.add_argument("--peers", nargs="*", default=["hf", "hf-lookup"], choices=["hf", "hf-lookup"])
    p.add_argument("--scheduled", action="store_true",
                   help="also run drafters that have a confidence head under the prefix scheduler (LABEL+sched)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--name", default="quick", help="name of the result files and of the BENCHMARKS.md section")
    p.add_argument("--out", default="bench", help="folder for the JSON result and the plots")
    p.add_argument("--markdown", default="BENCHMARKS.md")
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser("bench-train", help="cost of a training step under each efficiency lever")
    p.add_argument("--data", required=True, help="regenerated JSONL")
    p.add_argument("--model", default=__import__("dspark.models", fromlist=["x"]).DEFAULT_TARGET)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--steps", type=positive_int, default=4)
    p.add_argument("--batch-size", type=positive_int, default=4)
    p.add_argument("--markov-rank", type=int, default=64)
    p.add_argument("--out", default="bench")
    p.add_argument("--markdown", default="BENCHMARKS.md")
    p.set_defaults(func=cmd_bench_train)

    p = sub.add_parser("export", help="write a drafter checkpoint in another precision (e.g. bfloat16 to ship)")
    p.add_argument("checkpoint")
    p.add_argument("out")
    add_target_args(p)
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("profile", help="measure the verify cost table SPS(B) of this machine (JSON)")
    add_target_args(p)
    p.add_argument("--out", required=True)
    p.add_argument("--token-counts", type=int, nargs="+", default=[1, 2, 3, 4, 5, 6, 8, 12, 16])
    p.add_argument("--context", type=positive_int, default=256)
    p.add_argument("--repeats", type=positive_int, default=7)
    p.set_defaults(func=cmd_profile)

    p = sub.add_parser("calibrate", help="fit STS temperatures of a drafter's confidence head on real rounds")
    p.add_argument("--drafter", required=True)
    add_target_args(p)
    p.add_argument("--data", help="held-out prompts (messages/turns JSONL or .txt); default: --datasets")
    p.add_argument("--datasets", nargs="+", default=["mt-bench"], help="evaluation sets to draw prompts from")
    p.add_argument("--limit", type=positive_int, default=20, help="prompts (per dataset)")
    p.add_argument("--max-new-tokens", type=positive_int, default=128)
    p.add_argument("--out", required=True)
    p.add_argument("--plot", help="reliability plot PNG")
    p.set_defaults(func=cmd_calibrate)

    p = sub.add_parser("curves", help="plot held-out τ against training time and tokens for training runs")
    p.add_argument("--run", action="append", required=True, help="LABEL=RUN_FOLDER, repeatable")
    p.add_argument("--reference", help="label the others are compared with (default: the first --run)")
    p.add_argument("--out", required=True, help="PNG path")
    p.add_argument("--markdown", help="also write the comparison table as a section of this file (BENCHMARKS.md)")
    p.add_argument("--at-tokens", type=float, help="compare at this many training tokens (default: the furthest common)")
    p.add_argument("--at-minutes", type=float, help="compare at this training time (default: the furthest common)")
    p.set_defaults(func=cmd_curves)

    p = sub.add_parser("prompts", help="build the offline training prompt mix (chat, math, code, instructions)")
    p.add_argument("--out", required=True, help="prompts JSONL to write")
    p.add_argument("--count", type=positive_int, default=10000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-dir", default=str(default_eval_dir()), help="evaluation sets that prompts must not overlap")
    p.set_defaults(func=cmd_prompts)

    p = sub.add_parser("regenerate", help="have the target answer every prompt (resumable JSONL)")
    p.add_argument("--prompts", required=True, help="messages JSONL, turns JSONL or .txt prompts")
    p.add_argument("--out", required=True, help="JSONL to append to; a rerun continues where it stopped")
    add_target_args(p)
    add_sampling_args(p)
    p.add_argument("--max-new-tokens", type=positive_int, default=384)
    p.add_argument("--batch-size", type=positive_int, default=32)
    p.add_argument("--limit", type=int, default=0, help="only the first N records (0 = all)")
    p.set_defaults(func=cmd_regenerate)

    p = sub.add_parser("train", help="train a drafter for a target (alone or under torchrun)")
    p.add_argument("--data", help="training JSONL (regenerated chat records)")
    p.add_argument("--out", required=True, help="run folder: checkpoint/, metrics.jsonl")
    p.add_argument("--resume", action="store_true", help="continue the run in --out exactly where it stopped")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--model", help="target (known name or HF folder)")
    p.add_argument("--target-dtype", choices=["float32", "bfloat16"])
    p.add_argument("--preset", choices=["dspark", "dflash", "eagle3", "mtp1"])
    g = p.add_argument_group("drafter")
    g.add_argument("--block-size", type=positive_int)
    g.add_argument("--num-draft-layers", type=positive_int)
    g.add_argument("--markov-rank", type=int)
    g.add_argument("--markov-head-type", choices=["vanilla", "gated", "rnn"])
    g.add_argument("--no-confidence-head", dest="enable_confidence_head", action="store_false", default=None)
    g.add_argument("--draft-vocab-size", type=int, help="0 = the target's whole vocabulary")
    g.add_argument("--feature-norm", action="store_true", default=None)
    g.add_argument("--target-layer-ids", type=lambda t: [int(x) for x in t.split(",")], help="e.g. 1,8,14,21,28")
    g.add_argument("--mask-token-id", type=int, help="default: an unused token of the target")
    g.add_argument("--no-init-target-layers", dest="init_target_layers", action="store_false", default=None)
    g.add_argument("--init-from", help="continue training an existing drafter checkpoint")
    g = p.add_argument_group("loss")
    g.add_argument("--ce-weight", type=float)
    g.add_argument("--tv-weight", type=float)
    g.add_argument("--conf-weight", type=float)
    g.add_argument("--decay", type=float, help="position weight exp(-(k-1)/decay); <= 0 disables")
    g.add_argument("--target-topk", type=int, help="keep the target distribution's top K (0 = full)")
    g.add_argument("--num-anchors", type=positive_int)
    g.add_argument("--max-length", type=positive_int)
    g = p.add_argument_group("optimisation")
    g.add_argument("--epochs", type=float)
    g.add_argument("--max-steps", type=int)
    g.add_argument("--batch-size", type=positive_int)
    g.add_argument("--grad-accum", type=positive_int)
    g.add_argument("--lr", type=float)
    g.add_argument("--warmup-ratio", type=float)
    g.add_argument("--weight-decay", type=float)
    g.add_argument("--clip", type=float)
    g.add_argument("--no-bf16", dest="bf16", action="store_false", default=None)
    g.add_argument("--device", help="auto (default: this rank's GPU if CUDA is available, else CPU), cpu, cuda:N")
    g.add_argument("--feature-cache", help="folder for the on-disk target feature cache (built on first use)")
    g.add_argument("--holdout", type=float)
    g.add_argument("--eval-every", type=positive_int)
    g.add_argument("--save-every", type=positive_int)
    g.add_argument("--seed", type=int)
    p.set_defaults(func=cmd_train)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except DSparkError as e:
        print(f"dspark: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("dspark: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
