"""The `dspark` command. The only module that reads command-line arguments; each subcommand calls the library."""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from dspark.errors import DSparkError
from dspark.formats import EXPORT_FORMATS
from dspark.fsutil import check_input_file, check_output_dir, check_output_file


# ---- shared argument groups ------------------------------------------------------------------------------------
def add_target_args(p: argparse.ArgumentParser, auto_dtype: bool = True) -> None:
    from dspark.models import DEFAULT_TARGET

    p.add_argument("--model", default=DEFAULT_TARGET, help=f"known target name or HF model folder (default {DEFAULT_TARGET})")
    if auto_dtype:
        p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                       help="target precision; auto: the faster one on this CPU (measured once, cached). float32 "
                            "output of speculative decoding is token-for-token that of plain decoding")
        p.add_argument("--quantize", choices=["none", "int8"], default="none",
                       help="int8: weight-only int8 target (per-channel scales); plain and speculative decoding "
                            "share it, so they still agree")
    else:
        p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="precision of the weights")
    p.add_argument("--threads", type=threads, default=0, help="torch CPU threads (0 = torch's default)")


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--temperature", type=finite_float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=nonnegative_int, default=0, help="0 = off")
    p.add_argument("--top-p", type=finite_float, default=1.0, help="1 = off")
    p.add_argument("--seed", type=int, default=None)


def sampling_from(args):
    from dspark.sampling import SamplingParams

    return SamplingParams(args.temperature, args.top_k, args.top_p, args.seed)


def positive_int(text: str) -> int:
    value = _int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def nonnegative_int(text: str) -> int:
    value = _int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {value}")
    return value


def threads(text: str) -> int:
    """0 (torch's default) up to a few times the machine's cores: more only thrashes."""
    import os

    value, most = _int(text), 4 * (os.cpu_count() or 1)
    if not 0 <= value <= most:
        raise argparse.ArgumentTypeError(f"must be between 0 (torch's default) and {most} on this machine, got {value}")
    return value


def is_plain_name(text: str) -> bool:
    """Letters, digits, '.', '_', '-': safe as a file name and inside a markdown section marker."""
    import re

    return re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", text) is not None


def section_name(text: str) -> str:
    if not is_plain_name(text):
        raise argparse.ArgumentTypeError(f"{text!r} must be a plain name (letters, digits, '.', '_', '-')")
    return text


def finite_float(text: str) -> float:
    import math

    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text}")
    return value


def int_list(text: str) -> list[int]:
    return [_int(x) for x in text.split(",")]


def prompt_mix(text: str) -> dict[str, float]:
    mix = {}
    for part in text.split(","):
        name, _, share = part.partition("=")
        try:
            mix[name.strip()] = float(share)
        except ValueError:
            raise argparse.ArgumentTypeError(f"write each share as SOURCE=NUMBER, got {part!r}") from None
        if not math.isfinite(mix[name.strip()]) or mix[name.strip()] < 0:
            raise argparse.ArgumentTypeError(f"a share must be a number >= 0, got {part!r}")
    return mix


def str_list(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None


def default_eval_dir():
    from pathlib import Path

    return Path(__file__).parent / "data" / "eval"


def setup_torch(args) -> None:
    import torch

    if getattr(args, "threads", 0):
        torch.set_num_threads(args.threads)


def load_target(args, layer_ids=None):
    """The target in --dtype; for auto, the precision this machine runs fastest (said on stderr, with why)."""
    from dspark.target import Target

    setup_torch(args)
    if args.dtype == "auto":
        from dspark.scheduling.precision import choose_precision

        loaded = {}

        def load(dtype):
            loaded[dtype] = Target.load(args.model, dtype=dtype, layer_ids=layer_ids, quantize=args.quantize)
            return loaded[dtype]

        choice = choose_precision(args.model + ("-int8" if args.quantize == "int8" else ""), load)
        args.dtype = choice.dtype
        print(f"dspark: precision {choice.dtype}: {choice.reason} (--dtype overrides)", file=sys.stderr)
        return loaded.get(choice.dtype) or load(choice.dtype)
    return Target.load(args.model, dtype=args.dtype, layer_ids=layer_ids, quantize=getattr(args, "quantize", None))


def build_policy(args, target=None, drafter_path=None):
    from dspark.decoding.policy import ConfidenceThreshold, FixedLength

    if args.schedule or args.cost_table:
        from dspark.scheduling.planner import build_scheduler

        return build_scheduler(target, drafter_path, args.cost_table, args.calibration, args.scheduler)
    if args.calibration:
        raise DSparkError("--calibration sets the scheduler's temperatures; add --schedule (or --cost-table)")
    if args.confidence_threshold is not None:
        return ConfidenceThreshold(args.confidence_threshold)
    return FixedLength(args.verify_length)


def add_policy_args(p: argparse.ArgumentParser) -> None:
    """One way to choose verification lengths per command: the flags of the others are refused beside it."""
    g = p.add_mutually_exclusive_group()
    g.add_argument("--verify-length", type=nonnegative_int, default=None,
                   help="verify this many draft tokens per round (default γ)")
    g.add_argument("--confidence-threshold", type=finite_float, default=None, help="verify up to the first c_k below this")
    g.add_argument("--schedule", action="store_true",
                   help="confidence-scheduled verification (Algorithm 1) with this machine's cost table (profiled once, "
                        "cached) and the drafter's shipped calibration; --cost-table / --calibration replace either")
    p.add_argument("--cost-table", help="cost table JSON (`dspark profile`) for the scheduler (implies --schedule)")
    p.add_argument("--calibration", help="STS temperatures JSON (`dspark calibrate`) for the scheduler")
    p.add_argument("--scheduler", choices=["algorithm1", "production"], default="algorithm1",
                   help="algorithm1: the paper's prefix search with early stop; production: a global budget from "
                        "confidences two steps old, spent on the current best candidates (paper §5.2)")


def check_policy_args(args) -> None:
    """Verification flags make sense together and with a drafter; the drafter is a checkpoint (before any load)."""
    if not args.drafter and (args.schedule or args.cost_table or args.calibration or args.verify_length is not None
                             or args.confidence_threshold is not None):
        raise DSparkError("verification flags (--schedule, --verify-length ...) apply to speculative decoding; "
                          "add --drafter PATH")
    check_drafter_arg(args.drafter)
    if args.cost_table and (args.verify_length is not None or args.confidence_threshold is not None):
        raise DSparkError("--cost-table schedules verification; it cannot be combined with --verify-length or "
                          "--confidence-threshold")
    check_given_files(args, ("cost_table", "calibration"))
    if args.calibration:
        from dspark.scheduling.calibration import read_temperatures

        read_temperatures(args.calibration)
    if args.cost_table:
        from dspark.scheduling.profile import CostTable

        CostTable.load(args.cost_table)


def check_given_files(args, names) -> None:
    """Each of these optional file arguments, when given, names an existing file."""
    for name in names:
        if getattr(args, name):
            check_input_file(getattr(args, name), f"--{name.replace('_', '-')}")


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


def check_drafter_arg(path) -> None:
    """A --drafter that is not a checkpoint (or ngram:DATA file) is refused before the target loads."""
    from dspark.drafter import NGRAM_PREFIX, read_checkpoint_meta

    if path and str(path).startswith(NGRAM_PREFIX):
        if not Path(str(path)[len(NGRAM_PREFIX):]).is_file():
            raise DSparkError(f"--drafter {path}: no data file there (ngram:DATA wants regenerated JSONL)")
    elif path:
        read_checkpoint_meta(path)


def cmd_generate(args) -> int:
    from dspark.decoding.plain import generate_plain

    from dspark.target import check_text

    if not check_text(args.prompt).strip():
        raise DSparkError("the prompt is empty; give the model something to answer")
    if args.compare_plain and not args.drafter:
        raise DSparkError("--compare-plain compares speculative decoding with plain decoding; add --drafter PATH")
    check_policy_args(args)
    sampling = sampling_from(args)
    target = load_target(args)
    prompt = target.encode_chat(args.prompt)
    stream = None if args.json else TextStream(target.tokenizer)

    engine = None
    if args.drafter:
        from dspark.decoding.engine import SpeculativeEngine
        from dspark.drafter import load_proposer

        engine = SpeculativeEngine(target, load_proposer(args.drafter, target), build_policy(args, target, args.drafter))
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
        plain = generate_plain(target, [prompt], args.max_new_tokens, sampling)[0]
        report.update(
            plain_tokens_per_s=round(plain.tokens_per_s, 3),
            speedup=round(result.tokens_per_s / plain.tokens_per_s, 3) if plain.tokens_per_s else None,
            identical_to_plain=plain.token_ids == result.token_ids,
            first_difference=None if plain.token_ids == result.token_ids
            else common_prefix(plain.token_ids, result.token_ids),
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
        line += "identical output" if report["identical_to_plain"] else (
            f"OUTPUT DIFFERS from plain decoding from token {report['first_difference'] + 1} on"
            f"{why_outputs_differ(args.dtype, sampling)}")
    print(line + "]", file=sys.stderr)
    return 0


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def why_outputs_differ(dtype: str, sampling=None) -> str:
    """Why speculative and plain output can part, for the message that says they did."""
    if sampling is not None and not sampling.greedy:
        return (" (sampling: the two runs draw different random numbers; they agree in distribution, not token by "
                "token; pass --seed and --temperature 0 to compare tokens)")
    if dtype == "float32":
        return " (float32 output should be identical: please report this with the command)"
    return (f" ({dtype}: at a near-tie two tokens' logits differ by less than {dtype} rounding, and a forward of one "
            "token and a forward of many round differently; --dtype float32 gives identical output)")


def cmd_demo(args) -> int:
    import textwrap

    from dspark.assets import shipped_drafter
    from dspark.bench.demo import run_demo
    from dspark.decoding.policy import FixedLength
    from dspark.drafter import load_drafter
    from dspark.scheduling.planner import build_scheduler

    if args.fixed and args.cost_table:
        raise DSparkError("--cost-table is for the scheduler and --fixed turns it off; pass one of them")
    drafter_path = args.drafter or shipped_drafter(args.model)
    check_drafter_arg(drafter_path)
    check_given_files(args, ("cost_table",))
    target = load_target(args)
    drafter = load_drafter(drafter_path, target)
    policy = FixedLength()
    if drafter.confidence_head is not None and not args.fixed:
        policy = build_scheduler(target, drafter_path, args.cost_table)
    print(f"target {args.model} ({args.dtype}), drafter {drafter_path}, greedy, γ={drafter.block_size}, "
          f"verification: {policy.describe()}, max {args.max_new_tokens} new tokens\n")
    rows = run_demo(target, drafter, args.datasets, args.per_set, args.max_new_tokens, policy)
    why = why_outputs_differ(args.dtype)
    for r in rows:
        same = "IDENTICAL" if r.identical else f"DIFFER from token {r.same_prefix + 1} on{why}"
        print(f"=== {r.dataset}: {textwrap.shorten(r.prompt, 100)}")
        print(f"--- DSpark (τ={r.tau:.2f}, {r.spec_tokens_per_s:.1f} tok/s) vs plain ({r.plain_tokens_per_s:.1f} tok/s): "
              f"speed-up {r.speedup:.2f}x, outputs {same}")
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


def parse_labelled(items: list[str], flag: str, example: str) -> dict[str, str]:
    pairs = {}
    for item in items:
        label, sep, path = item.partition("=")
        if not sep or not label or not path:
            raise DSparkError(f"{flag} takes LABEL=PATH (e.g. {example}), got '{item}'")
        pairs[label] = path
    return pairs


def check_bench_args(args, drafters) -> Path:
    """A benchmark's drafters, evaluation sets and output paths, refused before any model loads. Returns --out."""
    from dspark.assets import eval_path

    name = getattr(args, "name", "x")
    if not is_plain_name(name):
        raise DSparkError(f"--name {name!r} must be a plain name (letters, digits, '.', '_', '-'): it names the "
                          "result files inside --out and a section of the markdown file")
    for path in drafters:
        check_drafter_arg(path)
    for name in args.datasets:
        eval_path(name)
    check_output_file(args.markdown, "--markdown")
    return check_output_dir(args.out, "--out")


def cmd_bench(args) -> int:
    import os
    import shlex

    from dspark.assets import shipped_drafter
    from dspark.bench.report import markdown_section, plots, write_section
    from dspark.bench.run import BenchConfig, run_bench
    from dspark.fsutil import atomic_write_json

    drafters = parse_labelled(args.drafter or [f"dspark={shipped_drafter(args.model)}"], "--drafter",
                              "dspark=runs/drafter/checkpoint")
    out = check_bench_args(args, drafters.values())
    setup_torch(args)
    cfg = BenchConfig(model=args.model, datasets=args.datasets, prompts_per_set=args.prompts_per_set,
                      max_new_tokens=args.max_new_tokens, temperatures=args.temperatures, dtypes=args.dtypes,
                      drafters=drafters, peers=args.peers, seed=args.seed, scheduled=args.scheduled)
    run = run_bench(cfg, progress=lambda line: print(line, file=sys.stderr))
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

    from dspark.bench.report import write_section
    from dspark.bench.training import levers_markdown, time_levers
    from dspark.fsutil import atomic_write_json

    out = check_output_dir(args.out, "--out")
    check_output_file(args.markdown, "--markdown")
    setup_torch(args)
    base = dict(markov_rank=args.markov_rank, num_anchors=64)
    rows = time_levers(args.data, args.model, base, steps=args.steps, batch_size=args.batch_size)
    command = "dspark " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out / "training-levers.json", {"command": command, "rows": rows})
    write_section(Path(args.markdown), "training-levers", levers_markdown(rows, command))
    for r in rows:
        print(json.dumps(r))
    return 0


def cmd_bench_signal(args) -> int:
    from dspark.assets import eval_prompts, shipped_drafter
    from dspark.bench.signal import signal_plot, signal_report, signal_section
    from dspark.drafter import load_drafter, read_checkpoint_meta, training_totals
    from dspark.training.data import spread_slice
    from dspark.training.trainer import load_examples

    if not 0 <= args.holdout < 1:
        raise DSparkError(f"--holdout is a share of the records: give the training run's value in [0, 1), got "
                          f"{args.holdout}")
    path = args.drafter or shipped_drafter(args.model)
    out = check_bench_args(args, [path])
    target = load_target(args)
    drafter = load_drafter(path, target).eval()
    slices = {}
    if args.data:
        train, held, _ = load_examples(target, args.data, args.max_length, args.holdout, args.allow_foreign_data)
        slices = {"train": spread_slice(train, args.examples), "held-out": spread_slice(held, args.examples)}
    prompts = {Path(name).stem: [target.encode_chat(p) for p in eval_prompts(name, args.prompts_per_set, args.offset)]
               for name in args.datasets}
    rows = signal_report(drafter, target, slices, prompts, args.max_new_tokens,
                         progress=lambda r: print(json.dumps(r), file=sys.stderr))
    run = {"drafter": str(path), "training": training_totals(read_checkpoint_meta(path)), "dtype": args.dtype,
           "rows": rows}
    publish(run, out, args.name, lambda: signal_plot(rows, out / f"{args.name}.png"),
            lambda run_, command, plot: signal_section(run_, command, plot, args.name), args.markdown)
    return 0


def cmd_bench_engine(args) -> int:
    from dspark.assets import shipped_drafter
    from dspark.bench.engine import run_engine_bench
    from dspark.bench.report import engine_plot, engine_section

    drafter = args.drafter or shipped_drafter(args.model)
    out = check_bench_args(args, [drafter])
    setup_torch(args)
    run = run_engine_bench(args.model, args.dtypes, drafter, args.datasets, args.max_new_tokens,
                           progress=lambda line: print(line, file=sys.stderr))
    publish(run, out, args.name, lambda: engine_plot(run, out / f"{args.name}-forward.png"),
            lambda run_, command, plot: engine_section(run_, command, plot, args.name), args.markdown)
    return 0


def publish(run: dict, out: Path, name: str, plot, section, markdown: str) -> None:
    """Stamp a benchmark run (command, machine, time), then write NAME.json in `out`, its plot and section NAME of
    the markdown file."""
    import os
    import shlex
    import time

    from dspark.bench.report import write_section
    from dspark.bench.run import machine_info
    from dspark.fsutil import atomic_write_json

    env = f"OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']} " if "OMP_NUM_THREADS" in os.environ else ""
    run.update(command=env + "dspark " + shlex.join(sys.argv[1:]), machine=machine_info(),
               when=time.strftime("%Y-%m-%d %H:%M:%S %Z"))
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out / f"{name}.json", run)
    png = plot()
    path = Path(markdown)
    write_section(path, name, section(run, run["command"], os.path.relpath(png, path.parent)))
    print(f"dspark: wrote {out / (name + '.json')}, {png} and section '{name}' of {path}", file=sys.stderr)


def gguf_arg(given: str | None, model: str) -> Path:
    """The target's GGUF: the given file, else the one a known target's package carries."""
    from dspark.models import target_gguf

    path = Path(given) if given else target_gguf(model)
    if not path.is_file():
        raise DSparkError(f"{path} does not exist; pass the GGUF file of the target model")
    return path


def cmd_bench_llama_cpp(args) -> int:
    import tempfile

    import torch

    from dspark.assets import shipped_drafter
    from dspark.bench.llamacpp import run_llama_cpp_bench
    from dspark.bench.report import llama_cpp_plot, llama_cpp_section
    from dspark.drafter import load_drafter
    from dspark.formats.gguf import export_gguf, float32_gguf, gguf_weights

    drafter_path = Path(args.drafter or shipped_drafter(args.model))
    out = check_bench_args(args, [drafter_path])
    target_gguf = gguf_arg(args.target_gguf, args.model)
    target = load_target(args)
    drafter = load_drafter(drafter_path, target)
    with tempfile.TemporaryDirectory(prefix="dspark-llama-") as scratch:  # the GGUFs are big and rebuilt in seconds
        scratch = Path(scratch)
        draft = export_gguf(drafter, target, scratch, torch.float32, target_gguf)
        targets = {}
        if args.llama_weights in ("as-shipped", "both"):
            targets[gguf_weights(target_gguf)] = target_gguf
        if args.llama_weights in ("float32", "both"):
            targets["float32"] = float32_gguf(target_gguf, scratch / f"{target_gguf.stem}.f32.gguf")
        run = run_llama_cpp_bench(target, drafter, drafter_path, draft, targets, Path(args.llama_bin), args.datasets,
                                  args.prompts_per_set, args.max_new_tokens, args.p_min, torch.get_num_threads(),
                                  progress=lambda line: print(line, file=sys.stderr))
    publish(run, out, "llama-cpp", lambda: llama_cpp_plot(run, out / "llama-cpp.png"), llama_cpp_section,
            args.markdown)
    return 0


def cmd_bench_serve(args) -> int:
    from dspark.assets import eval_prompts, shipped_drafter
    from dspark.bench.report import serve_plot, serve_section
    from dspark.bench.serve import run_serve_bench
    from dspark.drafter import load_drafter

    drafter_path = args.drafter or shipped_drafter(args.model)
    out = check_bench_args(args, [drafter_path])
    prompts = [p for name in args.datasets for p in eval_prompts(name, args.prompts_per_set)]
    target = load_target(args)
    drafter = load_drafter(drafter_path, target)
    rows = run_serve_bench(target, drafter, drafter_path, prompts, args.concurrency, args.max_tokens,
                           args.requests_per_level, progress=lambda line: print(line, file=sys.stderr))
    run = {"rows": rows, "model": args.model, "dtype": args.dtype, "drafter": str(drafter_path),
           "datasets": args.datasets, "max_tokens": args.max_tokens, "requests_per_level": args.requests_per_level}
    publish(run, out, "serve", lambda: serve_plot(rows, out / "serve-pareto.png"), serve_section, args.markdown)
    return 0


def cmd_export(args) -> int:
    from dspark.drafter import load_drafter, read_checkpoint_meta
    from dspark.formats import export_drafter
    from dspark.fsutil import check_replaceable
    from dspark.target import parse_dtype

    source, out = Path(args.checkpoint), Path(args.out)
    meta = read_checkpoint_meta(source)
    check_replaceable(out, args.overwrite, source)
    target = load_target(args)
    drafter = load_drafter(source, target)
    target_gguf = gguf_arg(args.target_gguf, args.model) if args.format == "gguf" else None
    carried = export_drafter(source, out, args.format, drafter, target, parse_dtype(args.dtype), meta, target_gguf)
    note = f", with {', '.join(carried)}" if carried else ""
    if args.format == "dspark" and "calibration.json" not in carried:
        note += ", no calibration.json to carry (run `dspark calibrate`)"
    print(f"dspark: wrote {out} ({args.format}, {args.dtype}){note}", file=sys.stderr)
    if args.format == "gguf":
        draft = next(out.glob("*.gguf"))
        print(f"run it with llama.cpp:\n  llama-server -m {target_gguf} -md {draft} --spec-type draft-dspark "
              f"--spec-draft-n-max {drafter.block_size}", file=sys.stderr)
    return 0


def cmd_import(args) -> int:
    from dspark.formats import import_drafter
    from dspark.fsutil import check_replaceable

    source, out = Path(args.source), Path(args.out)
    if not source.is_dir():
        raise DSparkError(f"{source} is not a folder; `dspark import` reads a speculators or DeepSpec drafter folder")
    check_replaceable(out, args.overwrite, source)
    fmt = import_drafter(source, out, load_target(args))
    print(f"dspark: imported the {fmt} drafter {source} into {out} (run `dspark calibrate` before scheduling with it)",
          file=sys.stderr)
    return 0


def cmd_profile(args) -> int:
    from dspark.scheduling.profile import profile_target

    check_output_file(args.out, "--out")
    target = load_target(args)
    table = profile_target(target, tuple(args.token_counts), args.context, args.repeats, tuple(args.batch_sizes))
    table.save(args.out)
    one = table.meta["grid"][0]["ms"]
    for g in table.meta["grid"]:
        print(f"batch {g['batch_size']:>3} x {g['tokens_per_row']:>3} tokens  {g['ms']:8.2f} ms  "
              f"({g['ms'] / one:.2f}x one token)")
    print(f"dspark: wrote {args.out}", file=sys.stderr)
    return 0


def cmd_calibrate(args) -> int:
    from dspark.assets import eval_prompts
    from dspark.drafter import load_drafter
    from dspark.fsutil import atomic_write_json
    from dspark.scheduling.calibration import collect_rounds, fit_sts, reliability_plot, report
    from dspark.training.data import read_records

    check_drafter_arg(args.drafter)
    check_output_file(args.out, "--out")
    if args.plot:
        check_output_file(args.plot, "--plot")
    if args.data:
        texts = [next(m["content"] for m in r["messages"] if m["role"] == "user") for r in read_records(args.data)]
        texts = texts[: args.limit]
    else:
        texts = [t for name in args.datasets for t in eval_prompts(name, args.limit)]
    target = load_target(args)
    drafter = load_drafter(args.drafter, target)
    rounds = collect_rounds(target, drafter, [target.encode_chat(t) for t in texts], args.max_new_tokens)
    temps = fit_sts(rounds)
    rows = report(rounds, temps)
    atomic_write_json(args.out, {"sts_temperatures": temps, "rounds": len(rounds.logits), "report": rows,
                                 "drafter": str(args.drafter), "prompts": len(texts)})
    if args.plot:
        reliability_plot(rounds, temps, args.plot)
    for r in rows:
        print(json.dumps(r))
    print(f"dspark: {len(rounds.logits)} rounds; STS temperatures {temps}; wrote {args.out}", file=sys.stderr)
    return 0


def cmd_curves(args) -> int:
    import os
    import shlex

    from dspark.bench.report import curves_table, training_curves, write_section

    runs = {}
    for label, path in parse_labelled(args.run, "--run", "dspark=runs/dspark").items():
        if not (Path(path) / "metrics.jsonl").is_file():
            raise DSparkError(f"--run {label}={path}: {path} has no metrics.jsonl (give a `dspark train` run folder)")
        runs[label] = Path(path)
    reference = args.reference or next(iter(runs))
    if reference not in runs:
        raise DSparkError(f"--reference '{reference}' is not one of the --run labels ({', '.join(runs)})")
    check_output_file(args.out, "--out")
    if args.markdown:
        check_output_file(args.markdown, "--markdown")
    curves = training_curves(runs, Path(args.out))
    if not all(curves.values()):
        raise DSparkError(f"runs without a held-out evaluation yet: {', '.join(k for k, v in curves.items() if not v)}")
    markdown = Path(args.markdown) if args.markdown else None
    plot = os.path.relpath(args.out, markdown.parent) if markdown else str(args.out)
    table = curves_table(curves, reference, "dspark " + shlex.join(sys.argv[1:]), plot, args.at_tokens,
                         args.at_minutes * 60 if args.at_minutes else None, args.title)
    print(table)
    if markdown:
        write_section(markdown, args.section, table)
        print(f"dspark: wrote {args.out} and the {args.section} section of {markdown}", file=sys.stderr)
    return 0


def cmd_scaling(args) -> int:
    from dspark.bench.scaling import read_point, scaling_plot, scaling_section, scaling_table

    goals = {"*": 3.0}
    for item in args.goal:
        name, _, value = item.rpartition("=")
        try:
            goal = float(value)
        except ValueError:
            goal = math.nan
        if not goal > 1:
            raise DSparkError(f"--goal {item}: a goal is a τ above 1 (1 + accepted drafts per round), for every set "
                              "(3) or for one (mt-bench=2)")
        goals[name or "*"] = goal
    out = check_output_dir(args.out, "--out")
    check_output_file(args.markdown, "--markdown")
    points = [read_point(Path(p)) for p in args.signal]
    if len({p.tokens for p in points}) < 2:
        raise DSparkError("--signal: give bench-signal runs of at least two drafters trained for different amounts "
                          "(a fit needs two points)")
    run = {"goals": goals, "points": [vars(p) for p in sorted(points, key=lambda p: p.tokens)],
           "rows": scaling_table(points, goals)}
    publish(run, out, args.name, lambda: scaling_plot(run, out / f"{args.name}.png"),
            lambda run_, command, plot: scaling_section(run_, command, plot, args.name), args.markdown)
    return 0


def cmd_prompts(args) -> int:
    from dspark.fsutil import atomic_write_json, atomic_write_text
    from dspark.training.sources import build_prompts

    check_output_file(args.out, "--out")
    records, report = build_prompts(args.count, args.seed, args.eval_dir, args.mix)
    if args.exclude:
        from dspark.training.data import read_records

        def opening(record):  # the first user turn: the same opening is the same prompt to answer
            return next(m["content"].strip() for m in record["messages"] if m["role"] == "user")

        seen = {opening(r) for path in args.exclude for r in read_records(path)}
        kept = [r for r in records if opening(r) not in seen]
        report["excluded_already_answered"] = len(records) - len(kept)
        records = kept
    atomic_write_text(args.out, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
    atomic_write_json(str(args.out) + ".report.json", report)
    print(json.dumps(report))
    return 0


def cmd_regenerate(args) -> int:
    from dspark.target import Target, resolve_device
    from dspark.training.data import read_records
    from dspark.training.regenerate import completed_ids, regenerate

    prompts, out = Path(args.prompts), check_output_file(args.out, "--out")
    if out.exists() and prompts.exists() and out.resolve() == prompts.resolve():
        raise DSparkError(f"--out {out} is the prompts file; regeneration appends answers to a file of its own")
    records = read_records(prompts)
    if args.limit:
        records = records[: args.limit]
    completed_ids(out)  # an --out that is not regenerate output is refused before the target loads
    device = resolve_device(args.device)
    if device.type == "cpu":
        target = load_target(args)
    else:  # auto precision was measured for CPUs; a GPU answers in bfloat16
        setup_torch(args)
        target = Target.load(args.model, dtype="bfloat16" if args.dtype == "auto" else args.dtype, device=device,
                             quantize=args.quantize)
    llm = None
    if args.backend == "llama-cpp":
        import torch

        from dspark.training.llama_backend import load_llama

        llm = load_llama(gguf_arg(args.gguf, args.model), target, torch.get_num_threads())
    report = regenerate(target, records, out, args.max_new_tokens, args.batch_size, sampling_from(args), llm=llm,
                        max_seconds=60 * args.max_minutes)
    print(json.dumps(report))
    return 0


def cmd_train(args) -> int:
    from dataclasses import fields

    from dspark.training.trainer import TrainConfig, resumed_config, train

    given = {f.name: getattr(args, f.name) for f in fields(TrainConfig) if getattr(args, f.name, None) is not None}
    if args.resume:
        given.pop("out")
        cfg = resumed_config(args.out, given)
    else:
        if not args.data:
            raise DSparkError("--data is required (regenerated JSONL from `dspark regenerate`)")
        cfg = TrainConfig(**given)
        check_input_file(cfg.data, "--data")
        if (Path(cfg.out) / "checkpoint").exists():
            raise DSparkError(f"{cfg.out} already holds a run; continue it with --resume, or choose a new --out")
    if cfg.init_from:
        check_drafter_arg(cfg.init_from)
    check_output_dir(cfg.out, "--out")
    setup_torch(args)
    result = train(cfg, resume=args.resume, progress=not args.quiet)
    print(json.dumps(result))
    return 0


def cmd_serve(args) -> int:
    import os

    from dspark.decoding.engine import SpeculativeEngine
    from dspark.drafter import load_proposer
    from dspark.serve.app import ServeConfig, create_app
    from dspark.serve.local import DrainingServer, server_config

    check_policy_args(args)
    config = ServeConfig(model_name=args.served_model_name or args.model,
                         api_key=args.api_key or os.environ.get("DSPARK_API_KEY") or None, max_batch=args.max_batch,
                         max_concurrent=args.max_concurrent, max_tokens_limit=args.max_tokens_limit,
                         max_body_bytes=args.max_body_bytes, drain_seconds=args.drain_seconds)
    target = load_target(args)
    drafter = load_proposer(args.drafter, target) if args.drafter else None
    engine = SpeculativeEngine(target, drafter, build_policy(args, target, args.drafter) if drafter else None)
    if args.host not in ("127.0.0.1", "localhost", "::1"):
        print(f"dspark: serving on {args.host}, reachable from other machines"
              f"{'' if config.api_key else ' WITHOUT an API key (--api-key or DSPARK_API_KEY)'}", file=sys.stderr)
    print(f"dspark: serving '{config.model_name}' ({'speculative, ' + engine.policy.describe() if drafter else 'plain'}"
          f" decoding) on http://{args.host}:{args.port}/v1", file=sys.stderr)
    app = create_app(engine, target.tokenizer, config)
    DrainingServer(server_config(app, args.host, args.port, config.drain_seconds)).run()
    return 0


# ---- parser ----------------------------------------------------------------------------------------------------
def add_config_flags(p: argparse.ArgumentParser, config_cls, skip=()) -> None:
    """One flag per field of a config dataclass, from the field's type, default and help: an option is declared once,
    in the dataclass. Every flag defaults to None so that only what the user typed overrides the config."""
    import dataclasses

    types = {"int": int, "float": finite_float, "str": str, "list[int]": int_list, "list[str]": str_list}
    for f in dataclasses.fields(config_cls):
        if f.name in skip:
            continue
        name = "--" + f.metadata.get("flag", f.name.replace("_", "-"))
        kind = f.type.replace(" | None", "")
        common = dict(dest=f.name, default=None, help=f.metadata["help"])
        if kind == "bool":
            p.add_argument(name, action=argparse.BooleanOptionalAction, **common)
        else:
            p.add_argument(name, type=types[kind], choices=f.metadata.get("choices"), **common)


def build_parser() -> argparse.ArgumentParser:
    from dspark.models import DEFAULT_TARGET

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
    p.add_argument("--drafter", help="drafter checkpoint folder (or ngram:DATA, the n-gram floor): decode speculatively")
    add_policy_args(p)
    p.add_argument("--compare-plain", action="store_true", help="also run plain decoding; report speed-up and identity")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server (continuous batching, plain or speculative)")
    add_target_args(p)
    p.add_argument("--drafter", help="drafter checkpoint: decode speculatively (default: plain decoding)")
    add_policy_args(p)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: this machine only)")
    p.add_argument("--port", type=positive_int, default=8000)
    p.add_argument("--api-key", help="require 'Authorization: Bearer KEY' (default: $DSPARK_API_KEY, else none)")
    p.add_argument("--served-model-name", help="the model name clients ask for (default: --model)")
    p.add_argument("--max-batch", type=positive_int, default=32, help="requests decoding together")
    p.add_argument("--max-concurrent", type=positive_int, default=64,
                   help="requests admitted or waiting; more are answered 429")
    p.add_argument("--max-tokens-limit", type=positive_int, default=2048, help="largest max_tokens a request may ask")
    p.add_argument("--max-body-bytes", type=positive_int, default=1 << 20, help="largest request body (413 above)")
    p.add_argument("--drain-seconds", type=finite_float, default=10.0,
                   help="on SIGINT/SIGTERM, requests in flight get this long to finish before they are ended")
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("demo", help="plain vs DSpark side by side with the shipped drafter")
    add_target_args(p)
    p.add_argument("--drafter", help="drafter checkpoint (default: the one shipped for --model)")
    p.add_argument("--datasets", nargs="+", default=["humaneval", "gsm8k", "mt-bench"])
    p.add_argument("--per-set", type=positive_int, default=1)
    p.add_argument("--max-new-tokens", type=positive_int, default=128)
    p.add_argument("--fixed", action="store_true", help="verify all γ draft tokens every round (no scheduler)")
    p.add_argument("--cost-table", help="cost table JSON (`dspark profile`) for the scheduler instead of this "
                                        "machine's (profiled once, cached)")
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("bench", help="τ, speed, agreement and memory of every method, side by side")
    p.add_argument("--model", default=DEFAULT_TARGET)
    p.add_argument("--threads", type=threads, default=0)
    p.add_argument("--datasets", nargs="+", default=["humaneval", "gsm8k", "mt-bench", "mbpp", "math500"],
                   help="evaluation set names or JSONL paths of {\"turns\": [...]} records")
    p.add_argument("--prompts-per-set", type=positive_int, default=3)
    p.add_argument("--max-new-tokens", type=positive_int, default=128)
    p.add_argument("--temperatures", type=finite_float, nargs="+", default=[0.0, 1.0])
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

    p = sub.add_parser("bench-engine", help="forward cost of our engine vs HF and llama.cpp, against the bandwidth bound")
    p.add_argument("--model", default=DEFAULT_TARGET)
    p.add_argument("--threads", type=threads, default=0)
    p.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"], choices=["float32", "bfloat16", "int8"],
                   help="int8: weight-only int8 with bfloat16 activations")
    p.add_argument("--name", default="engine", help="name of the result files and of the BENCHMARKS.md section")
    p.add_argument("--drafter", help="drafter for the DSpark rows (default: the shipped one)")
    p.add_argument("--datasets", nargs="+", default=["humaneval", "gsm8k", "mt-bench", "mbpp", "math500"])
    p.add_argument("--max-new-tokens", type=positive_int, default=96)
    p.add_argument("--out", default="bench")
    p.add_argument("--markdown", default="BENCHMARKS.md")
    p.set_defaults(func=cmd_bench_engine)

    p = sub.add_parser("bench-llama-cpp", help="llama.cpp (plain, n-gram, our drafter as GGUF) beside our engine")
    add_target_args(p)
    p.add_argument("--drafter", help="dspark drafter checkpoint, exported to GGUF for llama.cpp (default: shipped)")
    p.add_argument("--llama-bin", required=True,
                   help="folder with llama.cpp's llama-completion and llama-speculative-simple (docs/formats.md)")
    p.add_argument("--target-gguf", help="the target's GGUF for llama.cpp (default: the known target's own file)")
    p.add_argument("--datasets", nargs="+", default=["gsm8k", "math500", "humaneval", "mbpp", "mt-bench"])
    p.add_argument("--prompts-per-set", type=positive_int, default=2)
    p.add_argument("--max-new-tokens", type=positive_int, default=128)
    p.add_argument("--p-min", type=float, default=0.5, help="llama.cpp's --spec-draft-p-min for the threshold row")
    p.add_argument("--llama-weights", choices=["as-shipped", "float32", "both"], default="both",
                   help="llama.cpp runs the target's GGUF as shipped (quantized: what users run), a float32 copy "
                        "of it (our arithmetic: outputs and acceptance comparable with ours), or both")
    p.add_argument("--out", default="bench")
    p.add_argument("--markdown", default="BENCHMARKS.md")
    p.set_defaults(func=cmd_bench_llama_cpp)

    p = sub.add_parser("bench-serve", help="the server under load: latency and throughput per verification policy")
    add_target_args(p)
    p.add_argument("--drafter", help="drafter for the speculative policies (default: the shipped one)")
    p.add_argument("--concurrency", type=positive_int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    p.add_argument("--requests-per-level", type=positive_int, default=8,
                   help="requests per concurrency level at least (each client sends its share back to back)")
    p.add_argument("--max-tokens", type=positive_int, default=32)
    p.add_argument("--datasets", nargs="+", default=["mt-bench", "gsm8k", "humaneval"])
    p.add_argument("--prompts-per-set", type=positive_int, default=8)
    p.add_argument("--out", default="bench")
    p.add_argument("--markdown", default="BENCHMARKS.md")
    p.set_defaults(func=cmd_bench_serve)

    p = sub.add_parser("bench-signal", help="where a drafter's acceptance is lost: teacher-forced on training, "
                                            "held-out and the target's own answers, against real decoding")
    add_target_args(p)
    p.add_argument("--drafter", help="drafter checkpoint (default: the shipped one)")
    p.add_argument("--data", help="the drafter's regenerated training JSONL (adds the training and held-out slices)")
    p.add_argument("--holdout", type=finite_float, default=0.02, help="the training run's --holdout")
    p.add_argument("--max-length", type=positive_int, default=1024, help="the training run's --max-length")
    p.add_argument("--allow-foreign-data", action="store_true", help="data regenerated by another target")
    p.add_argument("--examples", type=positive_int, default=32, help="records per training and held-out slice")
    p.add_argument("--datasets", nargs="+", default=["gsm8k", "humaneval", "mt-bench", "math500", "mbpp"])
    p.add_argument("--prompts-per-set", type=positive_int, default=4)
    p.add_argument("--offset", type=nonnegative_int, default=0, help="skip this many prompts of each set")
    p.add_argument("--max-new-tokens", type=positive_int, default=96)
    p.add_argument("--name", default="signal", help="name of the result files and of the BENCHMARKS.md section")
    p.add_argument("--out", default="bench")
    p.add_argument("--markdown", default="BENCHMARKS.md")
    p.set_defaults(func=cmd_bench_signal)

    p = sub.add_parser("bench-train", help="cost of a training step under each efficiency lever")
    p.add_argument("--data", required=True, help="regenerated JSONL")
    p.add_argument("--model", default=DEFAULT_TARGET)
    p.add_argument("--threads", type=threads, default=0)
    p.add_argument("--steps", type=positive_int, default=4)
    p.add_argument("--batch-size", type=positive_int, default=4)
    p.add_argument("--markov-rank", type=nonnegative_int, default=64)
    p.add_argument("--out", default="bench")
    p.add_argument("--markdown", default="BENCHMARKS.md")
    p.set_defaults(func=cmd_bench_train)

    p = sub.add_parser("export", help="write a drafter in another precision or format (speculators for vLLM, "
                                      "deepspec, gguf for llama.cpp)")
    p.add_argument("checkpoint")
    p.add_argument("out", help="a new folder (the model card, and for dspark the calibration, travel with the weights)")
    p.add_argument("--format", choices=EXPORT_FORMATS, default="dspark",
                   help="dspark (default), speculators (vLLM --speculative-config), deepspec, gguf (llama.cpp "
                        "--spec-type draft-dspark); see docs/formats.md")
    p.add_argument("--target-gguf", help="--format gguf: the target's GGUF, whose vocabulary the draft copies "
                                         "(default: the file a known target's package carries)")
    p.add_argument("--overwrite", action="store_true", help="replace an earlier output of this command (never a folder holding other files)")
    add_target_args(p, auto_dtype=False)
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("import", help="convert a speculators or DeepSpec DSpark drafter into a dspark checkpoint")
    p.add_argument("source", help="the drafter folder (config.json + safetensors)")
    p.add_argument("out", help="a new folder for the dspark checkpoint")
    p.add_argument("--overwrite", action="store_true", help="replace an earlier output of this command (never a folder holding other files)")
    add_target_args(p, auto_dtype=False)
    p.set_defaults(func=cmd_import)

    p = sub.add_parser("profile", help="measure the verify cost table SPS(B) of this machine (JSON)")
    add_target_args(p)
    p.add_argument("--out", required=True)
    p.add_argument("--token-counts", type=positive_int, nargs="+", default=[1, 2, 3, 4, 5, 6, 8, 12, 16])
    p.add_argument("--context", type=positive_int, default=256)
    p.add_argument("--repeats", type=positive_int, default=7)
    p.add_argument("--batch-sizes", type=positive_int, nargs="+", default=[1],
                   help="rows per forward; the table is indexed by the tokens a forward carries in all")
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
    p.add_argument("--at-tokens", type=finite_float, help="compare at this many training tokens (default: the furthest common)")
    p.add_argument("--at-minutes", type=finite_float, help="compare at this training time (default: the furthest common)")
    p.add_argument("--section", default="training-curves", type=section_name,
                   help="name of the --markdown section to write (others are kept)")
    p.add_argument("--title", default="Training curves: drafters trained alike", help="heading of that section")
    p.set_defaults(func=cmd_curves)

    p = sub.add_parser("scaling", help="real τ of a drafter's legs against its cumulative training compute, fitted "
                                       "and extrapolated to a goal τ")
    p.add_argument("--signal", nargs="+", required=True, help="bench-signal result JSONs, one per drafter (leg)")
    p.add_argument("--goal", nargs="+", default=["3"], help="the τ to extrapolate to: for every set (3) and/or per "
                                                            "set (mt-bench=2)")
    p.add_argument("--name", default="scaling", type=section_name, help="name of the result files and section")
    p.add_argument("--out", default="bench")
    p.add_argument("--markdown", default="BENCHMARKS.md")
    p.set_defaults(func=cmd_scaling)

    p = sub.add_parser("prompts", help="build the offline training prompt mix (chat, math, code, instructions)")
    p.add_argument("--out", required=True, help="prompts JSONL to write")
    p.add_argument("--count", type=positive_int, default=10000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-dir", default=str(default_eval_dir()), help="evaluation sets that prompts must not overlap")
    p.add_argument("--mix", type=prompt_mix, help="shares per source, e.g. assist=1 or chat=0.18,math=0.39,code=0.39,"
                                                  "instruct=0.04 (default: chat 0.08, assist 0.10, math 0.39, code "
                                                  "0.39, instruct 0.04)")
    p.add_argument("--exclude", nargs="+", default=[], metavar="JSONL",
                   help="drop prompts whose opening user turn one of these files (JSONL or .jsonl.gz: earlier "
                        "regenerated sets) already holds, so new regeneration answers only new prompts")
    p.set_defaults(func=cmd_prompts)

    p = sub.add_parser("regenerate", help="have the target answer every prompt (resumable JSONL)")
    p.add_argument("--prompts", required=True, help="messages JSONL, turns JSONL or .txt prompts")
    p.add_argument("--out", required=True, help="JSONL to append to; a rerun continues where it stopped")
    add_target_args(p)
    add_sampling_args(p)
    p.add_argument("--max-new-tokens", type=positive_int, default=384)
    p.add_argument("--batch-size", type=positive_int, default=32)
    p.add_argument("--limit", type=nonnegative_int, default=0, help="only the first N records (0 = all)")
    p.add_argument("--backend", choices=["dspark", "llama-cpp"], default="dspark",
                   help="who answers: our engine (batched) or llama.cpp on the target's GGUF (one sequence per "
                        "process, faster per core; needs llama-cpp-python)")
    p.add_argument("--gguf", help="--backend llama-cpp: the target's GGUF (default: the known target's own file)")
    p.add_argument("--device", default="cpu", help="cpu, auto or cuda:N: answer on a GPU (where --dtype auto means "
                                                   "bfloat16)")
    p.add_argument("--max-minutes", type=finite_float, default=0.0,
                   help="start no new conversation after this many minutes (0 = no limit); those under way are "
                        "finished and written, and a rerun continues with the rest")
    p.set_defaults(func=cmd_regenerate)

    from dspark.training.trainer import TrainConfig

    p = sub.add_parser("train", help="train a drafter for a target (alone or under torchrun)")
    p.add_argument("--out", required=True, help="run folder: checkpoint/, metrics.jsonl")
    p.add_argument("--resume", action="store_true",
                   help="continue the run in --out exactly where it stopped; only how long it runs may change, and --data "
                        "may name a file that appends records to what the run saw (they join from the next epoch)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--threads", type=threads, default=0)
    add_config_flags(p, TrainConfig, skip=("out",))
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
