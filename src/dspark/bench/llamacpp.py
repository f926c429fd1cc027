"""llama.cpp beside our engine on the same prompts (BENCHMARKS.md `llama-cpp`): llama.cpp plain, its n-gram
speculation, our drafter exported to GGUF at a fixed draft length and truncated at a confidence threshold
(`--spec-draft-p-min`), and our own engine plain, at a fixed length and with the scheduler.

llama.cpp runs as its own programs (`llama-completion`, `llama-speculative-simple`, built from the llama.cpp tree that
the llama-cpp-python source package carries; docs/formats.md says how), so what is measured is llama.cpp itself, not
our bindings. Greedy throughout: every speculative output must equal the plain output of the same runtime. Every
runtime is timed from the prompt to the last token, the prompt's evaluation included.

llama.cpp runs each method on two copies of the target: the GGUF as shipped (quantized, what users run) and a float32
copy of it, which does our float32 arithmetic, so there its plain output must equal ours and its acceptance of our
draft must match the acceptance our engine measures."""

from __future__ import annotations

import re
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from dspark.errors import DSparkError

TOOLS = ("llama-completion", "llama-speculative-simple")


@dataclass
class LlamaRun:
    text: str
    tokens: int
    seconds: float
    accepted: int | None = None  # draft tokens accepted (speculative runs)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds

    @property
    def tau(self) -> float | None:
        """Tokens per target verification: each round commits its accepted drafts and one token of the target."""
        return None if self.accepted is None else self.tokens / max(1, self.tokens - self.accepted)


def check_tools(bin_dir: Path) -> None:
    missing = [t for t in TOOLS if not (bin_dir / t).is_file()]
    if missing:
        raise DSparkError(
            f"{bin_dir} lacks {', '.join(missing)}; build them from the llama.cpp tree with cmake "
            "(docs/formats.md, 'Building llama.cpp') and pass the folder with --llama-bin"
        )


def _run(cmd: list[str], timeout: float) -> tuple[str, str]:
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired as e:
        raise DSparkError(f"{Path(cmd[0]).name} ran past {timeout:.0f} s: {' '.join(cmd[1:6])} ...") from e
    if done.returncode != 0:
        tail = "\n".join(done.stderr.strip().splitlines()[-5:])
        raise DSparkError(f"{Path(cmd[0]).name} failed (exit {done.returncode}):\n{tail}")
    return done.stdout, done.stderr


def _common(target_gguf: Path, prompt: str, max_new_tokens: int, threads: int) -> list[str]:
    return [
        "-m",
        str(target_gguf),
        "-p",
        prompt,
        "-n",
        str(max_new_tokens),
        "--temp",
        "0",
        "-t",
        str(threads),
        "-c",
        "4096",
        "--seed",
        "0",
    ]


def llama_plain(bin_dir: Path, target_gguf: Path, prompt: str, max_new_tokens: int, threads: int) -> LlamaRun:
    out, err = _run(
        [
            str(bin_dir / "llama-completion"),
            *_common(target_gguf, prompt, max_new_tokens, threads),
            "-no-cnv",
            "--no-display-prompt",
            "--simple-io",
        ],
        timeout=600,
    )
    prompt_eval = re.search(r"\bprompt eval time =\s*([\d.]+) ms", err)
    found = re.search(r"(?<!prompt )\beval time =\s*([\d.]+) ms /\s*(\d+) runs", err)
    if not found or not prompt_eval:
        raise DSparkError(
            "llama-completion printed no 'prompt eval time'/'eval time' lines; is it a build of this version?"
        )
    # Timed from the prompt, as ours: the prompt's evaluation gives the first token, each run one more.
    ms, runs = float(prompt_eval.group(1)) + float(found.group(1)), int(found.group(2))
    return LlamaRun(out.rstrip().removesuffix("[end of text]"), runs + 1, ms / 1000)


def llama_speculative(
    bin_dir: Path, target_gguf: Path, prompt: str, max_new_tokens: int, threads: int, spec_args: list[str]
) -> LlamaRun:
    out, err = _run(
        [str(bin_dir / "llama-speculative-simple"), *_common(target_gguf, prompt, max_new_tokens, threads), *spec_args],
        timeout=600,
    )
    encoded = re.search(r"encoded\s+\d+ tokens in\s+([\d.]+) seconds", err)
    decoded = re.search(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds", err)
    accepted = re.search(r"n_accept\s*=\s*(\d+)", err)
    if not encoded or not decoded or not accepted:
        raise DSparkError(
            "llama-speculative-simple printed no 'encoded'/'decoded'/'n_accept' lines; is it a build of this version?"
        )
    text = out.lstrip("\n")
    text = text[len(prompt) :] if text.startswith(prompt) else text  # it echoes the prompt first
    seconds = float(encoded.group(1)) + float(decoded.group(2))  # from the prompt, as ours
    return LlamaRun(text.rstrip("\n"), int(decoded.group(1)), seconds, int(accepted.group(1)))


def same_text(a: str, b: str) -> bool:
    """Equal greedy outputs: one is a prefix of the other (speculation may overshoot the token limit by a block)."""
    a, b = a.strip(), b.strip()
    return a.startswith(b) or b.startswith(a)


def ours_rows(target, engines: dict, ids: list[int], max_new_tokens: int) -> tuple[list[int], dict]:
    """Our plain decoding of one prompt and each engine's, each engine's output compared with the plain one. Returns
    the plain output's ids and the rows by method."""
    from dspark.decoding.plain import generate_plain

    ours = generate_plain(target, [ids], max_new_tokens)[0]
    rows: dict[str, dict] = {"plain": {"tok_s": round(ours.tokens_per_s, 2)}}
    for label, engine in engines.items():
        result = engine.generate([ids], max_new_tokens)[0]
        rows[label] = {
            "tok_s": round(result.tokens_per_s, 2),
            "tau": round(result.stats.tau, 3),
            "identical": result.token_ids == ours.token_ids,
        }
    return ours.token_ids, rows


def llama_rows(bin_dir: Path, gguf: Path, prompt: str, ours_text: str, max_new_tokens: int, threads: int, methods):
    """llama.cpp's plain decoding of one prompt (its text compared with ours) and each speculative method's (compared
    with llama.cpp's plain text), on one target GGUF."""
    plain = llama_plain(bin_dir, gguf, prompt, max_new_tokens, threads)
    rows = {"plain": {"tok_s": round(plain.tokens_per_s, 2), "same_as_ours": same_text(plain.text, ours_text)}}
    for label, args in methods.items():
        run = llama_speculative(bin_dir, gguf, prompt, max_new_tokens, threads, args)
        rows[label] = {
            "tok_s": round(run.tokens_per_s, 2),
            "tau": round(run.tau, 3),
            "identical": same_text(run.text, plain.text),
        }
    return rows


def run_llama_cpp_bench(
    target,
    drafter,
    drafter_path: Path,
    draft_gguf: Path,
    target_ggufs: dict[str, Path],
    bin_dir: Path,
    datasets,
    prompts_per_set: int,
    max_new_tokens: int,
    p_min: float,
    threads: int,
    progress=print,
) -> dict:
    """Each prompt through llama.cpp (per weights in `target_ggufs`: plain, n-gram, our draft at a fixed length and
    at a confidence threshold) and through our engine (plain, fixed length, scheduler). Row: runtime -> method ->
    {tok_s, tau, identical}; `identical` compares with the same runtime's plain output, and llama.cpp's plain output
    on float32 weights is compared with ours (`same_as_ours`)."""
    from dspark.assets import eval_prompts
    from dspark.bench.run import warm_dspark_engines

    check_tools(bin_dir)
    out, err = _run([str(bin_dir / "llama-completion"), "--version"], timeout=60)
    version = next(
        (line.split("version:")[1].strip() for line in (out + err).splitlines() if "version:" in line), "unknown"
    )
    gamma = drafter.block_size
    engines = warm_dspark_engines(target, drafter, drafter_path)
    draft = ["-md", str(draft_gguf), "--spec-type", "draft-dspark", "--spec-draft-n-max", str(gamma)]
    llama_methods = {
        "ngram": ["--spec-type", "ngram-simple"],
        "dspark": [*draft, "--spec-draft-p-min", "0"],
        f"dspark p>={p_min}": [*draft, "--spec-draft-p-min", str(p_min)],
    }
    ours_name = f"ours {str(target.dtype).removeprefix('torch.')}"
    rows = []
    for name in datasets:
        for i, messages in enumerate(eval_prompts(name, prompts_per_set)):
            ids = target.encode_chat(messages)
            start = time.perf_counter()
            ours, runtimes = ours_rows(target, engines, ids, max_new_tokens)
            runtimes = {ours_name: runtimes}
            ours_text = target.tokenizer.decode(ours, skip_special_tokens=True)
            prompt = target.tokenizer.decode(ids)
            for weights, target_gguf in target_ggufs.items():
                runtimes[f"llama.cpp {weights}"] = llama_rows(
                    bin_dir, target_gguf, prompt, ours_text, max_new_tokens, threads, llama_methods
                )
            rows.append(
                {"dataset": name, "prompt": i, "runtimes": runtimes, "seconds": round(time.perf_counter() - start, 1)}
            )
            progress(
                f"{name}[{i}] "
                + "  ".join(
                    f"{r} {m}: {v['tok_s']}" + (f" τ{v['tau']}" if "tau" in v else "")
                    for r, ms in runtimes.items()
                    for m, v in ms.items()
                )
            )
    return {
        "rows": rows,
        "model": target.name,
        "dtype": str(target.dtype).removeprefix("torch."),
        "drafter": str(drafter_path),
        "draft_gguf": str(draft_gguf),
        "target_ggufs": {w: Path(p).name for w, p in target_ggufs.items()},
        "llama_bin": str(bin_dir),
        "llama_cpp_version": version,
        "threads": threads,
        "p_min": p_min,
        "max_new_tokens": max_new_tokens,
        "prompts_per_set": prompts_per_set,
        "datasets": list(datasets),
        "gamma": gamma,
    }
