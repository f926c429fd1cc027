"""`dspark bench clients`: the clients users already have, unchanged, against `dspark serve` plain and speculative.

Each server is started on a free loopback port in turn (one target, one engine at a time) and driven by:
- guidellm (`guidellm run`): synthetic prompts of a fixed token count, greedy, streamed to /v1/chat/completions with
  the body guidellm sends (text parts, `ignore_eos`, usage on every chunk), at each number of concurrent streams;
- lm-evaluation-harness (`lm-eval run`): an evaluation set's prompts as a generation task read from the local file,
  greedy, through `local-completions` (raw prompts, sent `batch_size` to a request as a list) and
  `local-chat-completions` (the chat template applied by the server).

Each client runs as its own process, as a user runs it, and writes its own results; this module writes the
scenario and task files, reads their outputs, and compares what the two servers answered, prompt by prompt.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from dspark.errors import DSparkError
from dspark.fsutil import atomic_write_json, atomic_write_text
from dspark.serve.app import ServeConfig, create_app
from dspark.serve.local import LocalServer

CLIENTS = ("guidellm", "lm_eval")
LM_EVAL_MODELS = ("local-completions", "local-chat-completions")
TASK = "dspark_prompts"


def missing_clients() -> list[str]:
    """The client packages this machine lacks (the `clients` extra installs them)."""
    missing = []
    for name in CLIENTS:
        try:
            importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            missing.append(name)
    return missing


def client_versions() -> dict[str, str]:
    return {name: importlib.metadata.version(name) for name in CLIENTS}


def run_client(command: list[str], log: Path, timeout: float) -> tuple[int, float]:
    """Run a client's command line (stdout and stderr into `log`); its exit code and seconds. The clients are given
    every file they read (tokenizer, data), so they are told to stay off the model hub."""
    start = time.perf_counter()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    with open(log, "w") as out:
        try:
            code = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, timeout=timeout, env=env).returncode
        except subprocess.TimeoutExpired:
            code = -1
    return code, round(time.perf_counter() - start, 1)


# ---- guidellm ----------------------------------------------------------------------------------------------------
def guidellm_scenario(
    url: str, model: str, tokenizer: str, streams: list[int], requests: list[int], prompt_tokens: int, tokens: int
) -> dict:
    """A guidellm scenario: concurrent streams, each level ending after its number of requests; greedy (the only
    field added to guidellm's own request body is temperature 0)."""
    return {
        "metadata": {"name": "dspark-clients"},
        "spec": {
            "backend": {
                "kind": "openai_http",
                "target": url,
                "model": model,
                "request_format": "/v1/chat/completions",
                "extras": {"body": {"temperature": 0}},
            },
            "profile": {"kind": "concurrent", "streams": streams[0]},
            "constraints": [{"kind": "max_requests", "count": requests}],
            "tokenizer": {"kind": "huggingface_auto", "model": tokenizer},
            "data": [{"kind": "synthetic_text", "prompt_tokens": prompt_tokens, "output_tokens": tokens}],
            "seed": {"kind": "static", "value": 0},
        },
        "benchmarks": [{"profile.streams": n} for n in streams],
    }


def read_guidellm(path: Path, streams: list[int]) -> list[dict]:
    """Per level of a guidellm JSON report: requests by status, latencies, and each prompt's streamed text."""
    report = json.loads(path.read_text())
    levels = []
    for n, bench in zip(streams, report["benchmarks"]):
        requests = bench["requests"]
        done = requests.get("successful") or []
        ttft = [r["time_to_first_token_ms"] for r in done if r.get("time_to_first_token_ms") is not None]
        itl = [r["inter_token_latency_ms"] for r in done if r.get("inter_token_latency_ms") is not None]
        seconds = bench.get("duration") or max(1e-9, bench["end_time"] - bench["start_time"])
        tokens = sum(r.get("output_tokens") or 0 for r in done)
        levels.append(
            {
                "streams": n,
                "requests": len(done),
                "errors": len(requests.get("errored") or []),
                "incomplete": len(requests.get("incomplete") or []),
                "output_tokens": tokens,
                "output_tps": round(tokens / seconds, 1),
                "ttft_ms": round(statistics.median(ttft), 1) if ttft else None,
                "itl_ms": round(statistics.median(itl), 1) if itl else None,
                "texts": {prompt_of(r): r.get("output") or "" for r in done},
            }
        )
    return levels


def prompt_of(request: dict) -> str:
    """The messages a guidellm request sent (from its recorded request body)."""
    args = request.get("request_args") or "{}"
    body = (json.loads(args) if isinstance(args, str) else args).get("body") or {}
    return json.dumps(body.get("messages") or body.get("prompt"), sort_keys=True)


# ---- lm-evaluation-harness ---------------------------------------------------------------------------------------
def lm_eval_task(folder: Path, prompts: Path, max_tokens: int) -> Path:
    """A generation task over an evaluation file's first turns, read from the local file (no hub), greedy, in the
    question/answer form lm-eval's own GSM8K task uses (as a raw completion, an instruction-tuned model given the bare
    question ends its turn at once), scored by nothing (`--predict_only`: the answers are what is compared)."""
    folder.mkdir(parents=True, exist_ok=True)
    task = folder / f"{TASK}.yaml"
    atomic_write_text(
        task,
        "\n".join(
            [
                f"task: {TASK}",
                "dataset_path: json",
                "dataset_kwargs:",
                "  data_files:",
                f"    test: {json.dumps(str(prompts))}",
                "test_split: test",
                "output_type: generate_until",
                'doc_to_text: "Question: {{turns[0]}}\\nAnswer:"',
                'doc_to_target: ""',
                "generation_kwargs:",
                '  until: ["Question:", "\\n\\n\\n"]',
                "  do_sample: false",
                "  temperature: 0",
                f"  max_gen_toks: {max_tokens}",
                "metric_list:",
                "  - metric: bypass",
                "    aggregation: bypass",
                "    higher_is_better: true",
                "",
            ]
        ),
    )
    return folder


def lm_eval_command(
    kind: str, url: str, model: str, tokenizer: str, batch: int, tasks: Path, limit: int, out: Path
) -> list[str]:
    route = "chat/completions" if kind == "local-chat-completions" else "completions"
    model_args = f"model={model},base_url={url}/v1/{route},tokenizer={tokenizer},num_concurrent=1,max_retries=1"
    model_args += ",tokenized_requests=False"
    command = [sys.executable, "-m", "lm_eval", "run", "--model", kind, "--model_args", model_args]
    command += ["--tasks", TASK, "--include_path", str(tasks), "--limit", str(limit), "--batch_size", str(batch)]
    command += ["--predict_only", "--log_samples", "--output_path", str(out)]
    return command + (["--apply_chat_template"] if kind == "local-chat-completions" else [])


def read_lm_eval(out: Path) -> dict[int, str]:
    """Each document's answer from lm-eval's logged samples."""
    answers = {}
    for path in out.rglob(f"samples_{TASK}_*.jsonl"):
        for line in path.read_text().splitlines():
            sample = json.loads(line)
            answers[int(sample["doc_id"])] = sample["resps"][0][0]
    return answers


# ---- the run -----------------------------------------------------------------------------------------------------
def run_clients_bench(
    target,
    engines: dict,
    model: str,
    tokenizer: str,
    prompts: Path,
    out: Path,
    streams: list[int],
    requests_per_stream: int,
    prompt_tokens: int,
    max_tokens: int,
    lm_eval_limit: int,
    lm_eval_batch: int,
    progress,
) -> dict:
    """Every client against every engine (`engines`: label -> SpeculativeEngine), one server at a time; the
    clients' own files are kept under out/clients/."""
    work = out / "clients"
    work.mkdir(parents=True, exist_ok=True)
    tasks = lm_eval_task(work / "tasks", prompts, max_tokens)
    requests = [n * requests_per_stream for n in streams]
    guidellm_rows, lm_eval_rows = [], []
    texts: dict[tuple, dict] = {}
    for label, engine in engines.items():
        app = create_app(engine, target.tokenizer, ServeConfig(model, max_batch=max(streams)))
        with LocalServer(app) as server:
            scenario = work / f"guidellm-{label}.scenario.json"
            report = work / f"guidellm-{label}.json"
            atomic_write_json(
                scenario, guidellm_scenario(server.url, model, tokenizer, streams, requests, prompt_tokens, max_tokens)
            )
            progress(f"{label}: guidellm at {streams} streams")
            command = [sys.executable, "-m", "guidellm", "run", "-c", str(scenario), "--output"]
            command += [f"kind=json,path={report}", "--disable-console"]
            code, _ = run_client(command, work / f"guidellm-{label}.log", timeout=3600)
            if code != 0 or not report.exists():
                raise DSparkError(f"guidellm exited {code} against the {label} server; see {work}/guidellm-{label}.log")
            for level in read_guidellm(report, streams):
                texts[("guidellm", level["streams"], label)] = level.pop("texts")
                guidellm_rows.append({"server": label, **level})
            for kind in LM_EVAL_MODELS:
                batch = lm_eval_batch if kind == "local-completions" else 1  # chat requests carry one conversation
                progress(f"{label}: lm-eval {kind}, batch {batch}")
                result = work / f"lm-eval-{label}-{kind}"
                command = lm_eval_command(kind, server.url, model, tokenizer, batch, tasks, lm_eval_limit, result)
                code, seconds = run_client(command, work / f"lm-eval-{label}-{kind}.log", timeout=3600)
                answers = read_lm_eval(result) if code == 0 else {}
                texts[("lm-eval", kind, label)] = answers
                lm_eval_rows.append(
                    {
                        "server": label,
                        "model": kind,
                        "batch": batch,
                        "exit": code,
                        "answers": len(answers),
                        "s": seconds,
                    }
                )
    return {
        "clients": client_versions(),
        "guidellm": {"rows": guidellm_rows, "identical": agreement(texts, "guidellm", streams, engines)},
        "lm_eval": {"rows": lm_eval_rows, "identical": agreement(texts, "lm-eval", LM_EVAL_MODELS, engines)},
    }


def agreement(texts: dict, client: str, keys, engines: dict) -> dict[str, list[int]]:
    """Per level or model: [prompts the two servers answered identically, prompts both answered]."""
    first, second = list(engines)[:2]
    out = {}
    for key in keys:
        a, b = texts.get((client, key, first), {}), texts.get((client, key, second), {})
        shared = set(a) & set(b)
        out[str(key)] = [sum(a[p] == b[p] for p in shared), len(shared)]
    return out


def table(header: list[str], rows: list[list]) -> list[str]:
    cells = [header, ["---"] * len(header), *[["" if c is None else str(c) for c in row] for row in rows]]
    return ["| " + " | ".join(row) + " |" for row in cells]


def clients_section(run: dict, command: str, plot=None, name: str = "clients") -> str:
    from dspark.bench.report import section_header

    m = run["machine"]
    lines = section_header(f"## {name}", command, run["when"])
    versions = ", ".join(f"{k} {v}" for k, v in run["clients"].items())
    lines += [
        f"Machine: {m['cpu']}, {m['cores']} cores, flags {', '.join(m['cpu_flags']) or 'n/a'}, torch threads "
        f"{m['torch_threads']}. Clients: {versions}, each its own process. Target {run['model']} ({run['dtype']}); "
        f"speculative: {run['speculative']}.",
        "",
        f"guidellm: synthetic {run['prompt_tokens']}-token prompts, {run['max_tokens']} new tokens each (ignore_eos), "
        "greedy, streamed to /v1/chat/completions.",
        "",
    ]
    same = run["guidellm"]["identical"]
    lines += table(
        ["server", "streams", "requests", "errors", "output tok/s", "TTFT ms (median)", "ITL ms (median)", "identical"],
        [
            [
                r["server"],
                r["streams"],
                r["requests"],
                r["errors"] + r["incomplete"],
                r["output_tps"],
                r["ttft_ms"],
                r["itl_ms"],
                "{}/{}".format(*same[str(r["streams"])]),
            ]
            for r in run["guidellm"]["rows"]
        ],
    )
    same = run["lm_eval"]["identical"]
    lines += [
        "",
        f"lm-eval: the first {run['lm_eval_limit']} {run['dataset']} prompts as a generation task, greedy, up to "
        f"{run['max_tokens']} tokens (`--predict_only`: the answers are compared, not scored).",
        "",
    ]
    lines += table(
        ["server", "lm-eval model", "batch", "exit", "answers", "seconds", "identical"],
        [
            [r["server"], r["model"], r["batch"], r["exit"], r["answers"], r["s"], "{}/{}".format(*same[r["model"]])]
            for r in run["lm_eval"]["rows"]
        ],
    )
    return "\n".join(lines)
