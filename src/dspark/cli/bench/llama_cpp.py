"""`dspark bench llama-cpp`: llama.cpp (plain, n-gram, our drafter as GGUF) beside our engine."""

from __future__ import annotations

import sys
from pathlib import Path

from dspark.cli.args import add_target_args, gguf_arg, load_target, positive_int
from dspark.cli.bench import add_output_args, check_bench_args, publish


def register(sub) -> None:
    p = sub.add_parser("llama-cpp", help="llama.cpp (plain, n-gram, our drafter as GGUF) beside our engine")
    add_target_args(p)
    p.add_argument("--drafter", help="dspark drafter checkpoint, exported to GGUF for llama.cpp (default: shipped)")
    p.add_argument(
        "--llama-bin",
        required=True,
        help="folder with llama.cpp's llama-completion and llama-speculative-simple (docs/formats.md)",
    )
    p.add_argument("--target-gguf", help="the target's GGUF for llama.cpp (default: the known target's own file)")
    p.add_argument("--datasets", nargs="+", default=["gsm8k", "math500", "humaneval", "mbpp", "mt-bench"])
    p.add_argument("--prompts-per-set", type=positive_int, default=2)
    p.add_argument("--max-new-tokens", type=positive_int, default=128)
    p.add_argument("--p-min", type=float, default=0.5, help="llama.cpp's --spec-draft-p-min for the threshold row")
    p.add_argument(
        "--llama-weights",
        choices=["as-shipped", "float32", "both"],
        default="both",
        help="llama.cpp runs the target's GGUF as shipped (quantized: what users run), a float32 copy "
        "of it (our arithmetic: outputs and acceptance comparable with ours), or both",
    )
    add_output_args(p)
    p.set_defaults(func=run)


def run(args) -> int:
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
    with tempfile.TemporaryDirectory(prefix="dspark-llama-") as folder:  # the GGUFs are big and rebuilt in seconds
        scratch = Path(folder)
        draft = export_gguf(drafter, target, scratch, torch.float32, target_gguf)
        targets = {}
        if args.llama_weights in ("as-shipped", "both"):
            targets[gguf_weights(target_gguf)] = target_gguf
        if args.llama_weights in ("float32", "both"):
            targets["float32"] = float32_gguf(target_gguf, scratch / f"{target_gguf.stem}.f32.gguf")
        run = run_llama_cpp_bench(
            target,
            drafter,
            drafter_path,
            draft,
            targets,
            Path(args.llama_bin),
            args.datasets,
            args.prompts_per_set,
            args.max_new_tokens,
            args.p_min,
            torch.get_num_threads(),
            progress=lambda line: print(line, file=sys.stderr),
        )
    publish(run, out, "llama-cpp", lambda: llama_cpp_plot(run, out / "llama-cpp.png"), llama_cpp_section, args.markdown)
    return 0
