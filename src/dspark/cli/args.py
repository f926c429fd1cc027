"""Argument types and groups shared by the subcommands, and the steps every command takes before its work
(loading the target, checking paths and flags)."""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from dspark.errors import DSparkError
from dspark.fsutil import check_input_file


def add_target_args(p: argparse.ArgumentParser, auto_dtype: bool = True) -> None:
    from dspark.models import DEFAULT_TARGET
    from dspark.target import PRECISIONS

    p.add_argument(
        "--model", default=DEFAULT_TARGET, help=f"known target name or HF model folder (default {DEFAULT_TARGET})"
    )
    if auto_dtype:
        p.add_argument(
            "--dtype",
            default="auto",
            choices=["auto", *PRECISIONS],
            help="target precision; int8 / int4: weight-only 8-bit (a scale per output channel) or 4-bit (a step "
            "and minimum per group of 32 columns, the Q4_1 layout) with bfloat16 activations. auto: the fastest "
            "on this CPU (measured once, cached). Speculative output is token for token that of plain decoding in "
            "the same precision",
        )
    else:
        p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="precision of the weights")
    p.add_argument("--threads", type=threads, default=0, help="torch CPU threads (0 = torch's default)")


def add_compile_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--compile",
        action="store_true",
        help="decode through one graph compiled by inductor (int4 on a CPU; one request at a time): a "
        "faster step, compiled once per machine (minutes), then loaded in about half a minute",
    )


def add_drafter_output_args(p: argparse.ArgumentParser) -> None:
    """What export and import share: --overwrite for their output folder, and the target the drafter is for."""
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an earlier output of this command (never a folder holding other files)",
    )
    add_target_args(p, auto_dtype=False)


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
    if not any(mix.values()):
        raise argparse.ArgumentTypeError(f"at least one share must be above 0, got {text!r}")
    return mix


def str_list(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None


def default_eval_dir() -> Path:
    from dspark.assets import EVAL_DIR

    return EVAL_DIR


def setup_torch(args) -> None:
    import torch

    if getattr(args, "threads", 0):
        torch.set_num_threads(args.threads)


def keep_a_core_for_serving(args) -> None:
    """A server's torch threads, unless --threads says: one fewer than torch's default (the machine's cores), so the
    HTTP side has a core of its own. Sharing every core with it cost far more than the thread gives: on a 2-core
    EPYC in bfloat16, a plain server at 2 threads ran 21 and 46 tokens/s at 1 and 4 streams, at 1 thread 23 and 69
    (the engine's spinning worker threads stall whenever another thread takes their core)."""
    import torch

    if not args.threads:
        args.threads = max(1, torch.get_num_threads() - 1)


def load_target(args, layer_ids=None):
    """The target in --dtype, in this machine's fastest product forms; for auto, the precision this machine runs
    fastest (said on stderr, with why). The machine's tuning is measured the first time (`dspark autotune`), then
    read from the cache."""
    from dspark.autotune import choose_precision, tune
    from dspark.compiled import compile_target
    from dspark.target import load_precision

    setup_torch(args)
    if getattr(args, "compile", False) and args.dtype not in ("auto", "int4"):
        raise DSparkError(f"--compile runs int4 targets, not {args.dtype}; pass --dtype int4 or leave out --compile")
    loaded = {}  # a precision timed for `auto` is the target returned: loaded and tuned once

    def load(precision):
        if precision not in loaded:
            loaded[precision] = tune(load_precision(args.model, precision, layer_ids=layer_ids))
        return loaded[precision]

    if args.dtype == "auto":
        choice = choose_precision(args.model, load)
        args.dtype = choice.dtype
        print(f"dspark: precision {choice.dtype}: {choice.reason} (--dtype overrides)", file=sys.stderr)
    target = load(args.dtype)
    if getattr(args, "compile", False):
        print(f"dspark: compiling the {args.dtype} decode step (minutes the first time on a machine)", file=sys.stderr)
        compile_target(target)
    return target


def build_policy(args, target=None, drafter_path=None, batch_sizes: tuple[int, ...] = (1,), drafter=None):
    from dspark.decoding.policy import ConfidenceThreshold, FixedLength

    if args.schedule or args.cost_table:
        from dspark.scheduling.planner import build_scheduler

        return build_scheduler(
            target, drafter_path, args.cost_table, args.calibration, args.scheduler, batch_sizes, drafter
        )
    if args.calibration:
        raise DSparkError("--calibration sets the scheduler's temperatures; add --schedule (or --cost-table)")
    if args.confidence_threshold is not None:
        return ConfidenceThreshold(args.confidence_threshold)
    return FixedLength(args.verify_length)


def add_suffix_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--suffix",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="draft with suffix decoding beside the drafter, per round and row whichever is worth verifying "
        "(default: on where the drafter ships an answer index for it; --drafter suffix: suffix decoding alone)",
    )


def speculative_engine(args, target, batch_sizes: tuple[int, ...] = (1,)):
    """The engine for --drafter (beside suffix decoding where --suffix says so) and the verification flags."""
    from dspark.decoding.engine import SpeculativeEngine
    from dspark.drafter import load_proposer, model_drafter
    from dspark.drafter.hybrid import attune

    proposer = load_proposer(args.drafter, target, args.suffix, getattr(args, "isolate_requests", False))
    policy = build_policy(args, target, args.drafter, batch_sizes, drafter=model_drafter(proposer))
    return SpeculativeEngine(target, attune(proposer, policy), policy)


def add_policy_args(p: argparse.ArgumentParser) -> None:
    """One way to choose verification lengths per command: the flags of the others are refused beside it."""
    g = p.add_mutually_exclusive_group()
    g.add_argument(
        "--verify-length",
        type=nonnegative_int,
        default=None,
        help="verify this many draft tokens per round (default γ)",
    )
    g.add_argument(
        "--confidence-threshold", type=finite_float, default=None, help="verify up to the first c_k below this"
    )
    g.add_argument(
        "--schedule",
        action="store_true",
        help="confidence-scheduled verification (Algorithm 1) with this machine's cost table (profiled once, "
        "cached) and the drafter's shipped calibration; --cost-table / --calibration replace either",
    )
    p.add_argument("--cost-table", help="cost table JSON (`dspark profile`) for the scheduler (implies --schedule)")
    p.add_argument("--calibration", help="STS temperatures JSON (`dspark calibrate`) for the scheduler")
    p.add_argument(
        "--scheduler",
        choices=["algorithm1", "production"],
        default="algorithm1",
        help="algorithm1: the paper's prefix search with early stop; production: a global budget from "
        "confidences two steps old, spent on the current best candidates (paper §5.2)",
    )


def check_policy_args(args) -> None:
    """Verification flags make sense together and with a drafter; the drafter is a checkpoint (before any load)."""
    if not args.drafter and (
        args.schedule
        or args.cost_table
        or args.calibration
        or args.verify_length is not None
        or args.confidence_threshold is not None
    ):
        raise DSparkError(
            "verification flags (--schedule, --verify-length ...) apply to speculative decoding; add --drafter PATH"
        )
    check_drafter_arg(args.drafter)
    if args.cost_table and (args.verify_length is not None or args.confidence_threshold is not None):
        raise DSparkError(
            "--cost-table schedules verification; it cannot be combined with --verify-length or --confidence-threshold"
        )
    check_given_files(args, ("cost_table", "calibration"))
    if args.calibration:
        from dspark.scheduling.calibration import read_temperatures

        temps = read_temperatures(args.calibration)
        block = drafter_block_size(args.drafter)
        if block is not None and len(temps) != block:
            raise DSparkError(
                f"--calibration {args.calibration} has {len(temps)} temperatures; the drafter drafts {block} tokens a "
                "block and needs one per position. Calibrate this drafter with `dspark calibrate`"
            )
    if args.cost_table:
        from dspark.scheduling.profile import CostTable

        CostTable.load(args.cost_table)


def check_given_files(args, names) -> None:
    """Each of these optional file arguments, when given, names an existing file."""
    for name in names:
        if getattr(args, name):
            check_input_file(getattr(args, name), f"--{name.replace('_', '-')}")


def check_drafter_arg(path) -> None:
    """A --drafter that is not a checkpoint (or ngram:DATA file, suffix, suffix:INDEX or no-suffix:CHECKPOINT) is
    refused before the target loads."""
    from dspark.drafter import NGRAM_PREFIX, answer_index_of, checkpoint_of, read_checkpoint_meta
    from dspark.drafter.suffix import is_answer_index

    if not path:
        return
    if str(path).startswith(NGRAM_PREFIX):
        if not Path(str(path)[len(NGRAM_PREFIX) :]).is_file():
            raise DSparkError(f"--drafter {path}: no data file there (ngram:DATA wants regenerated JSONL)")
    elif (index := answer_index_of(path)) is not None:
        if not index.is_file() or not is_answer_index(index):
            raise DSparkError(
                f"--drafter {path}: {index} is not a suffix answer index (`dspark suffix-index` writes one)"
            )
    elif (checkpoint := checkpoint_of(path)) is not None:
        read_checkpoint_meta(checkpoint)


def drafter_block_size(path) -> int | None:
    """The drafts per block of a drafter checkpoint (None for other proposers, which are not calibrated)."""
    from dspark.drafter import checkpoint_of, read_checkpoint_meta

    checkpoint = checkpoint_of(path)
    if checkpoint is None:
        return None
    block = read_checkpoint_meta(checkpoint)["drafter"].get("block_size")
    return block if isinstance(block, int) else None


def port_number(text: str) -> int:
    port = _int(text)
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"a TCP port is 1 to 65535, got {port}")
    return port


def nonnegative_float(text: str) -> float:
    value = finite_float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be a number >= 0, got {text!r}")
    return value


def parse_labelled(items: list[str], flag: str, example: str) -> dict[str, str]:
    pairs = {}
    for item in items:
        label, sep, path = item.partition("=")
        if not sep or not label or not path:
            raise DSparkError(f"{flag} takes LABEL=PATH (e.g. {example}), got '{item}'")
        pairs[label] = path
    return pairs


def gguf_arg(given: str | None, model: str) -> Path:
    """The target's GGUF: the given file, else the one a known target's package carries."""
    from dspark.models import target_gguf

    path = Path(given) if given else target_gguf(model)
    if not path.is_file():
        raise DSparkError(f"{path} does not exist; pass the GGUF file of the target model")
    return path


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


def command_line() -> str:
    """The command as typed (with OMP_NUM_THREADS where set), for a benchmark's record of how it was run."""
    import os
    import shlex

    env = f"OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']} " if "OMP_NUM_THREADS" in os.environ else ""
    return env + "dspark " + shlex.join(sys.argv[1:])


def why_outputs_differ(target, sampling=None) -> str:
    """Why speculative and plain output can part, for the message that says they did."""
    if sampling is not None and not sampling.greedy:
        return (
            " (sampling: the two runs draw different random numbers; they agree in distribution, not token by "
            "token; pass --seed and --temperature 0 to compare tokens)"
        )
    if target.decoder.batch_invariant:
        return (
            f" ({target.precision} on a CPU is batch-invariant, so this is a defect: please report it with the command)"
        )
    return (
        f" ({target.precision} on {target.device.type}: a forward of one token and a forward of many round differently, "
        "so a near-tie can break either way; on a CPU every precision but float16 gives identical output)"
    )
