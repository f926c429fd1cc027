"""`dspark bench clients`: what guidellm and lm-eval write is read back (report shapes as guidellm 0.8 and lm-eval 0.4
write them), the two servers' texts are compared prompt by prompt, and the command refuses in one line where the
clients are not installed. The clients themselves run in the benchmark (BENCHMARKS.md, section `clients`)."""

from __future__ import annotations

import json

import pytest

from conftest import refused
from dspark.bench import clients


def guidellm_request(text: str, output: str, ttft: float, itl: float, tokens: int = 16) -> dict:
    """One request as guidellm's JSON report records it (the fields read here, as guidellm writes them)."""
    body = {
        "model": "m",
        "stream": True,
        "ignore_eos": True,
        "messages": [{"role": "user", "content": [{"type": "text", "text": text}]}],
    }
    return {
        "request_args": json.dumps({"method": None, "stream": True, "body": body}),
        "output": output,
        "output_tokens": tokens,
        "time_to_first_token_ms": ttft,
        "inter_token_latency_ms": itl,
    }


def guidellm_report(levels: list[list[dict]], errored: int = 0) -> dict:
    return {
        "benchmarks": [
            {"duration": 2.0, "requests": {"successful": done, "errored": [{}] * errored, "incomplete": []}}
            for done in levels
        ]
    }


def test_guidellm_levels_are_read_and_the_two_servers_texts_compared(tmp_path):
    plain = guidellm_report(
        [
            [guidellm_request("a b", "one", 100.0, 20.0)],
            [guidellm_request("a b", "one", 150.0, 30.0), guidellm_request("c d", "two", 250.0, 40.0)],
        ]
    )
    spec = guidellm_report(
        [
            [guidellm_request("a b", "one", 90.0, 10.0)],
            # answered in another order, and one text differs
            [guidellm_request("c d", "TWO", 200.0, 12.0), guidellm_request("a b", "one", 120.0, 14.0)],
        ],
        errored=1,
    )
    texts = {}
    rows = {}
    for label, report in (("plain", plain), ("speculative", spec)):
        path = tmp_path / f"{label}.json"
        path.write_text(json.dumps(report))
        for level in clients.read_guidellm(path, [1, 2]):
            texts[("guidellm", level["streams"], label)] = level.pop("texts")
            rows[(label, level["streams"])] = level
    assert rows[("plain", 2)] == {
        "streams": 2,
        "requests": 2,
        "errors": 0,
        "incomplete": 0,
        "output_tokens": 32,
        "output_tps": 16.0,
        "ttft_ms": 200.0,
        "itl_ms": 35.0,
    }
    assert rows[("speculative", 2)]["errors"] == 1
    engines = {"plain": None, "speculative": None}
    assert clients.agreement(texts, "guidellm", [1, 2], engines) == {"1": [1, 1], "2": [1, 2]}


def test_lm_eval_answers_are_read_per_document(tmp_path):
    folder = tmp_path / "out" / "model__name"
    folder.mkdir(parents=True)
    samples = [{"doc_id": i, "resps": [[f"answer {i}"]], "filtered_resps": [f"answer {i}"]} for i in (1, 0)]
    (folder / f"samples_{clients.TASK}_2026-12-07T23-00-00.jsonl").write_text(
        "".join(json.dumps(s) + "\n" for s in samples)
    )
    assert clients.read_lm_eval(tmp_path / "out") == {0: "answer 0", 1: "answer 1"}
    # the batch reaches local-completions only; each client reads the tokenizer and the data from local files
    command = clients.lm_eval_command("local-completions", "http://h:1", "m", "/tok", 4, tmp_path, 8, tmp_path / "o")
    assert command[command.index("--batch_size") + 1] == "4" and "tokenizer=/tok" in " ".join(command)
    chat = clients.lm_eval_command("local-chat-completions", "http://h:1", "m", "/tok", 1, tmp_path, 8, tmp_path)
    assert "--apply_chat_template" in chat and "base_url=http://h:1/v1/chat/completions" in " ".join(chat)


def test_the_task_and_the_scenario_are_what_the_installed_clients_accept(tmp_path):
    """Where the clients are installed: lm-eval loads the task from the local evaluation file, and guidellm's schema
    accepts the scenario (greedy, one level per number of streams)."""
    pytest.importorskip("lm_eval", reason="the clients extra (make clients) is not installed")
    pytest.importorskip("guidellm", reason="the clients extra (make clients) is not installed")
    from guidellm.schemas.benchmark.entrypoints import BenchmarkScenario
    from lm_eval.tasks import TaskManager

    from dspark.assets import eval_path

    folder = clients.lm_eval_task(tmp_path / "tasks", eval_path("gsm8k"), 32)
    task = TaskManager(include_path=str(folder)).load([clients.TASK])["tasks"][clients.TASK]
    first = next(iter(task.test_docs()))
    assert task.doc_to_text(first).startswith("Question: Janet") and task.doc_to_text(first).endswith("Answer:")
    scenario = BenchmarkScenario.model_validate(
        clients.guidellm_scenario("http://h:1", "m", "/t", [1, 4], [2, 8], 9, 8)
    )
    assert scenario.spec.backend.extras.body == {"temperature": 0} and scenario.spec.backend.target == "http://h:1"
    assert scenario.benchmarks == [{"profile.streams": 1}, {"profile.streams": 4}]


def test_the_report_says_what_each_client_did(tmp_path):
    run = {
        "when": "now",
        "machine": {"cpu": "cpu", "cores": 2, "cpu_flags": ["avx2"], "torch_threads": 1},
        "clients": {"guidellm": "0.8.1", "lm_eval": "0.4.13"},
        "model": "m",
        "dtype": "int4",
        "speculative": "d, prefix scheduler",
        "prompt_tokens": 128,
        "max_tokens": 64,
        "dataset": "gsm8k",
        "lm_eval_limit": 8,
        "guidellm": {
            "rows": [
                {
                    "server": "plain",
                    "streams": 1,
                    "requests": 2,
                    "errors": 0,
                    "incomplete": 0,
                    "output_tps": 9.5,
                    "ttft_ms": 100.0,
                    "itl_ms": 50.0,
                    "output_tokens": 128,
                }
            ],
            "identical": {"1": [2, 2]},
        },
        "lm_eval": {
            "rows": [{"server": "plain", "model": "local-completions", "batch": 4, "exit": 0, "answers": 8, "s": 9.0}],
            "identical": {"local-completions": [8, 8], "local-chat-completions": [0, 0]},
        },
    }
    text = clients.clients_section(run, "dspark bench clients")
    assert "| plain | 1 | 2 | 0 | 9.5 | 100.0 | 50.0 | 2/2 |" in text
    assert "| plain | local-completions | 4 | 0 | 8 | 9.0 | 8/8 |" in text and "guidellm 0.8.1" in text


def test_the_command_names_the_missing_clients_and_how_to_install_them(capsys, monkeypatch):
    monkeypatch.setattr(clients, "missing_clients", lambda: ["guidellm"])
    refused(capsys, "guidellm not installed; pip install 'dspark[clients]'", "bench", "clients")
