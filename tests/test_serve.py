"""`dspark serve` on loopback, driven by the official openai client (and raw HTTP where the client hides things):
streaming and whole answers, 32 concurrent clients, seeded sampling, disconnects, and bad input."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from conftest import tiny_drafter
from dspark.decoding.engine import SpeculativeEngine
from dspark.decoding.plain import generate_plain
from dspark.serve.app import ServeConfig, create_app
from dspark.serve.local import LocalServer
from dspark.target import Target


class LiveServer(LocalServer):
    def client(self, key="unused") -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0, timeout=60)

    def metric(self, name: str) -> float:
        text = httpx.get(self.url + "/metrics").text
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.split("\n") if line.startswith(name))


class SlowEngine(SpeculativeEngine):
    """Rounds that take a while, so a client can leave mid-answer."""

    def step(self, *args, **kwargs):
        time.sleep(0.03)
        return super().step(*args, **kwargs)


class GatedEngine(SpeculativeEngine):
    """Holds every round after the first until `release` is set: a request stays in flight for as long as a test
    needs, however slow the machine."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.release = threading.Event()
        self.rounds = 0

    def step(self, *args, **kwargs):
        self.rounds += 1
        if self.rounds > 1:
            self.release.wait(timeout=60)
        return super().step(*args, **kwargs)


@pytest.fixture(scope="module")
def tiny(tiny_run):
    folder, _ = tiny_run
    target = Target.load(str(folder))
    drafter = tiny_drafter(target, block_size=4, mask_token_id=63)
    return target, drafter


def words(n, start=5):
    return " ".join(f"t{start + i % 50}" for i in range(n))


def plain_text(target, messages, max_tokens):
    ids = generate_plain(target, [target.encode_chat(messages)], max_tokens)[0].token_ids
    return target.tokenizer.decode(ids, skip_special_tokens=True), len(ids)


def test_chat_whole_and_streamed_with_exact_usage(tiny):
    target, drafter = tiny
    app = create_app(SpeculativeEngine(target, drafter), target.tokenizer, ServeConfig("tiny"))
    messages = [{"role": "user", "content": words(6)}]
    expected, count = plain_text(target, messages, 20)
    with LiveServer(app) as server:
        client = server.client()
        whole = client.chat.completions.create(model="tiny", messages=messages, max_tokens=20, temperature=0)
        assert whole.choices[0].message.content == expected
        assert whole.usage.completion_tokens == count and whole.usage.prompt_tokens == len(target.encode_chat(messages))
        chunks = list(
            client.chat.completions.create(model="tiny", messages=messages, max_tokens=20, temperature=0, stream=True)
        )
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected
        assert chunks[-1].choices[0].finish_reason in ("stop", "length")
        with httpx.stream(
            "POST",
            server.url + "/v1/chat/completions",
            json={"model": "tiny", "messages": messages, "max_tokens": 5, "temperature": 0, "stream": True},
        ) as r:
            lines = [line for line in r.iter_lines() if line]
        assert lines[-1] == "data: [DONE]" and all(line.startswith("data: ") for line in lines)
        text = client.completions.create(model="tiny", prompt=words(4), max_tokens=6, temperature=0)
        assert text.choices[0].text and text.usage.completion_tokens <= 6
        assert client.models.list().data[0].id == "tiny"
        assert httpx.get(server.url + "/health").json()["status"] == "ok"


def test_32_concurrent_clients_get_what_they_get_alone(tiny):
    target, drafter = tiny
    app = create_app(SpeculativeEngine(target, drafter), target.tokenizer, ServeConfig("tiny", max_batch=16))
    prompts = [[{"role": "user", "content": words(2 + i % 7, start=5 + i)}] for i in range(32)]
    expected = [plain_text(target, p, 16)[0] for p in prompts]
    with LiveServer(app) as server:
        client = server.client()

        def ask(messages):
            return (
                client.chat.completions.create(model="tiny", messages=messages, max_tokens=16, temperature=0)
                .choices[0]
                .message.content
            )

        with ThreadPoolExecutor(32) as pool:
            got = list(pool.map(ask, prompts))
        assert got == expected
        assert server.metric("dspark_requests_total") == 32
        # they were decoded together: more than one row per engine round on average
        assert server.metric("dspark_batch_rows_sum") > 1.5 * server.metric("dspark_batch_rows_count")


def test_seeded_sampling_is_reproducible_and_plain_serving_works(tiny):
    target, _ = tiny
    app = create_app(SpeculativeEngine(target), target.tokenizer, ServeConfig("tiny"))  # no drafter: plain
    with LiveServer(app) as server:
        client = server.client()
        ask = lambda seed: (
            client.chat.completions.create(
                model="tiny",
                messages=[{"role": "user", "content": words(5)}],
                max_tokens=24,
                temperature=1.0,
                seed=seed,
            )
            .choices[0]
            .message.content
        )
        assert ask(7) == ask(7)
        assert len({ask(s) for s in range(6)}) > 1


def test_a_client_that_leaves_frees_its_row(tiny):
    target, drafter = tiny
    app = create_app(SlowEngine(target, drafter), target.tokenizer, ServeConfig("tiny", max_tokens_limit=500))
    with LiveServer(app) as server:
        with httpx.stream(
            "POST",
            server.url + "/v1/chat/completions",
            json={
                "model": "tiny",
                "messages": [{"role": "user", "content": words(5)}],
                "max_tokens": 500,
                "ignore_eos": True,  # mid-answer whatever the tiny model's greedy text (it may stop early)
                "temperature": 0,
                "stream": True,
            },
            timeout=30,
        ) as r:
            for i, _ in enumerate(r.iter_lines()):
                if i >= 3:
                    break
            assert server.metric("dspark_active_requests") == 1
        deadline = time.monotonic() + 10
        while server.metric("dspark_active_requests") > 0:
            assert time.monotonic() < deadline, "the abandoned request kept its row"
            time.sleep(0.05)
        assert server.metric('dspark_requests_total{reason="cancelled"}') == 1


def test_bad_requests_get_the_right_status_and_the_server_keeps_serving(tiny):
    import socket

    target, drafter = tiny
    config = ServeConfig("tiny", api_key="sekret", max_body_bytes=4096, max_tokens_limit=64, body_timeout_seconds=10)
    app = create_app(SpeculativeEngine(target, drafter), target.tokenizer, config)
    good = {"model": "tiny", "messages": [{"role": "user", "content": words(4)}], "max_tokens": 4}
    auth = {"Authorization": "Bearer sekret"}
    with LiveServer(app) as server:
        post = lambda body, headers=auth, raw=None: httpx.post(
            server.url + "/v1/chat/completions",
            headers={**headers, "Content-Type": "application/json"},
            content=raw if raw is not None else json.dumps(body),
            timeout=30,
        )
        cases = [
            (post(good, headers={}), 401, "invalid_api_key"),
            (post(good, headers={"Authorization": "Bearer wrong"}), 401, "invalid_api_key"),
            (post(None, raw="{not json"), 400, None),
            (post(dict(good, model="gpt-9")), 404, "model_not_found"),
            (post(dict(good, max_tokens=-3)), 400, None),
            (post(dict(good, max_tokens=10_000)), 400, None),
            (post(dict(good, temperature=float("inf")), raw=json.dumps(dict(good, temperature=1e999))), 400, None),
            (post(dict(good, messages=[{"role": "user", "content": words(1100)}])), 413, "request_too_large"),
        ]
        chunked = httpx.post(
            server.url + "/v1/chat/completions", headers=auth, content=iter([json.dumps(good).encode()]), timeout=30
        )  # no Content-Length
        cases.append((chunked, 411, "length_required"))
        for response, status, code in cases:
            assert response.status_code == status, (status, response.text)
            assert "message" in response.json()["error"] and (code is None or response.json()["error"]["code"] == code)
        with pytest.raises(openai.AuthenticationError):
            server.client("wrong").chat.completions.create(**good)
        ok = server.client("sekret").chat.completions.create(**good)
        assert ok.choices[0].message.content is not None
        # a client without the key is refused before its body is read: headers alone, no body, answered at once
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
            sock.sendall(
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: 4000\r\n\r\n"
            )
            started, reply = time.monotonic(), b""
            while b"invalid_api_key" not in reply and (chunk := sock.recv(4096)):
                reply += chunk
            assert reply.startswith(b"HTTP/1.1 401") and time.monotonic() - started < 2
    long_prompt = dict(good, messages=[{"role": "user", "content": words(1100)}])
    big = ServeConfig("tiny", max_body_bytes=1 << 20)
    with LiveServer(create_app(SpeculativeEngine(target, drafter), target.tokenizer, big)) as server:
        response = httpx.post(server.url + "/v1/chat/completions", json=long_prompt, timeout=30)
        assert response.status_code == 400 and response.json()["error"]["code"] == "context_length_exceeded"
        assert httpx.post(server.url + "/v1/chat/completions", json=good, timeout=30).status_code == 200


def test_requests_over_the_limit_are_answered_429(tiny):
    target, drafter = tiny
    config = ServeConfig("tiny", max_concurrent=1, max_tokens_limit=500)
    engine = GatedEngine(target, drafter)
    app = create_app(engine, target.tokenizer, config)
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": words(4)}],
        "max_tokens": 300,
        "stream": True,
        "temperature": 0,
    }
    with LiveServer(app) as server:
        with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=30) as r:
            next(r.iter_lines())
            second = httpx.post(server.url + "/v1/chat/completions", json=dict(body, stream=False), timeout=30)
            engine.release.set()
            assert second.status_code == 429 and second.json()["error"]["type"] == "rate_limit_error"


@pytest.mark.slow
@pytest.mark.real
def test_serving_the_real_target_with_the_shipped_drafter(real_target, tmp_path):
    """12 concurrent requests get what each gets alone, and /metrics watches the scheduler's calibration. The cost
    table is fixed and flat (a verify costs what a step does, as on a GPU), so that every round drafts on any
    machine: with this machine's own costs the scheduler may draft in a handful of rounds, too few to compare its
    predictions with."""
    from dspark.assets import shipped_drafter
    from dspark.drafter import load_drafter
    from dspark.scheduling.planner import build_scheduler
    from dspark.scheduling.profile import CostTable

    path = shipped_drafter("smollm2-135m-instruct")
    CostTable([1, 8, 64, 256], [50.0, 50.0, 50.0, 50.0]).save(tmp_path / "costs.json")
    scheduler = build_scheduler(real_target, path, str(tmp_path / "costs.json"))
    engine = SpeculativeEngine(real_target, load_drafter(path, real_target), scheduler)
    from dspark.assets import eval_prompts

    prompts = [
        [{"role": "user", "content": p}] for name in ("gsm8k", "mt-bench", "humaneval") for p in eval_prompts(name, 4)
    ]
    expected = [plain_text(real_target, p, 8)[0] for p in prompts]
    with LiveServer(create_app(engine, real_target.tokenizer, ServeConfig("smollm2-135m-instruct"))) as server:
        client = server.client()

        def ask(messages):
            return (
                client.chat.completions.create(
                    model="smollm2-135m-instruct", messages=messages, max_tokens=8, temperature=0
                )
                .choices[0]
                .message.content
            )

        with ThreadPoolExecutor(len(prompts)) as pool:
            assert list(pool.map(ask, prompts)) == expected  # all at once, each what it gets alone
        # the scheduler's expected tokens per round beside what the rounds yielded: calibration, watched live
        predicted, realised = (
            server.metric("dspark_predicted_round_tokens_total"),
            server.metric("dspark_round_tokens_total"),
        )
        assert realised > 0 and 0.5 < predicted / realised < 2
        # the calibration error since start, as the gauge says it and as the per-bin counters give it
        from dspark.bench.serve import round_metrics, scrape

        ece = server.metric("dspark_confidence_ece")
        rounds = round_metrics({}, scrape(server.url))
        assert 0 < ece < 1 and rounds["ece"] == pytest.approx(ece, abs=1e-4)
        # every round was priced at the flat table's 50 ms and timed: the cost model against the clock
        priced = server.metric("dspark_scheduled_round_priced_seconds_total")
        assert priced > 0 and priced == pytest.approx(0.05 * round(priced / 0.05))
        assert rounds["time_over_price"] > 0


def test_shutdown_lets_in_flight_requests_finish(tiny):
    """Stopping the server (uvicorn's graceful exit) drains the engine loop: a request already running completes."""
    target, drafter = tiny
    app = create_app(SlowEngine(target, drafter), target.tokenizer, ServeConfig("tiny"))
    result = {}
    server = LiveServer(app).__enter__()
    client = server.client()

    def ask():
        result["answer"] = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": words(4)}], max_tokens=40, temperature=0
        )

    worker = threading.Thread(target=ask)
    worker.start()
    deadline = time.monotonic() + 10
    while server.metric("dspark_active_requests") < 1:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    server.__exit__(None, None, None)
    worker.join(timeout=30)
    assert result["answer"].choices[0].finish_reason in ("stop", "length") and result["answer"].usage.completion_tokens


@pytest.mark.slow
def test_load_benchmark_reports_every_policy(tiny, tmp_path, monkeypatch):
    """`bench serve` mechanics on the tiny target with the hybrid: every policy at every level and repetition, the
    server's round metrics per level, intervals, matched throughput, the goals, both plots; a second run resumes from
    its log."""
    from dspark.bench import serve as bench_serve
    from dspark.bench.run import machine_info
    from dspark.bench.serve_report import serve_plots, serve_section
    from dspark.drafter import load_proposer
    from dspark.drafter.hybrid import HybridProposer
    from dspark.drafter.suffix import ANSWER_INDEX, write_answer_index
    from dspark.scheduling.profile import CostTable

    target, drafter = tiny
    grid = [{"batch_size": b, "tokens_per_row": w, "ms": 10.0 + b * w} for b in (1, 2) for w in (1, 4, 8)]
    table = CostTable([1, 8], [10.0, 12.0], {"grid": grid, "draft": [{"batch_size": 1, "ms": 2.0}]})
    monkeypatch.setattr("dspark.autotune.cached_cost_table", lambda _t, **_: table)
    drafter.save(tmp_path / "drafter", target.identity())
    write_answer_index([[int(t) for t in target.encode_text(words(9))]], tmp_path / "drafter" / ANSWER_INDEX)
    drafter = load_proposer(tmp_path / "drafter", target, isolate=True)  # the default: beside suffix decoding
    assert isinstance(drafter, HybridProposer)
    out = tmp_path / "out"
    out.mkdir()

    def bench(repetitions, fixed, progress):
        return bench_serve.run_serve_bench(
            target,
            drafter,
            tmp_path / "drafter",
            [words(3), words(5, start=9)],
            [1, 2],
            6,
            2,
            10**6,
            repetitions,
            out,
            fixed_lengths=fixed,
            progress=progress,
        )

    rows = bench(1, (1, 3), lambda _: None)
    assert {r["policy"] for r in rows} == {"plain", "fixed 1", "fixed 3", "threshold 0.5", "algorithm1", "production"}
    assert all(r["tokens"] > 0 and r["aggregate_tps"] > 0 and r["requests"] == 2 for r in rows)
    spec = [r for r in rows if r["policy"] != "plain"]
    assert all(r["rounds"] > 0 and r["tau"] >= 1 and 0 <= r["ece"] <= 1 for r in spec)
    assert all(r["predicted_over_realised"] > 0 for r in spec)
    # fixed lengths and the threshold draft every round; the schedulers may verify anchors alone
    assert all(r["drafted_share"] == 1 for r in spec if r["policy"] not in bench_serve.SCHEDULED)
    assert all(0 < r["drafted_share"] <= 1 for r in spec)
    # the schedulers' cost table against the clock, for the rounds they planned (and only theirs)
    assert all(("time_over_price" in r) == (r["policy"] in bench_serve.SCHEDULED) for r in rows)
    assert all(r["time_over_price"] > 0 for r in spec if r["policy"] in bench_serve.SCHEDULED)
    seen: list[str] = []
    # A second repetition of all but fixed 3: the first is read back from levels.jsonl, not measured again, and
    # fixed 3's one repetition stays in the report.
    rows = bench(2, (1,), seen.append)
    assert len(rows) == 22 and len(seen) == 10 and all('"repetition": 1' in line for line in seen)
    # Another precision of the same model (int4 computes in bfloat16 too) is another run: nothing is read back.
    monkeypatch.setattr(type(target), "precision", property(lambda _self: "int4"))
    assert len(bench(1, (1,), lambda _: None)) == 10
    monkeypatch.undo()
    summary = bench_serve.summarise(rows)
    assert all((r["repetitions"] == 1) == (r["policy"] == "fixed 3") for r in summary)
    assert all(r["aggregate_tps_ci"] is not None for r in summary if r["policy"] != "fixed 3")
    run = {
        "rows": rows,
        "summary": summary,
        "cost_table": {"grid": grid, "draft": table.meta["draft"]},
        "machine": machine_info(),
        "when": "now",
        "model": "tiny",
        "dtype": "float32",
        "drafter": "tiny",
        "datasets": ["x"],
        "max_tokens": 6,
        "min_requests": 2,
        "min_tokens": 10**6,
        "repetitions": 2,
    }
    text = serve_section(run, "dspark bench serve", {"pareto": "p.png", "cost": "c.png"})
    assert "| algorithm1 | 2 |" in text and "best fixed policy" in text and "matched throughput" in text
    assert "1.3x fixed 1: not measured" not in text
    # a run without fixed 1 judges nothing against it; its files and section carry the run's name
    run["summary"] = [r for r in summary if r["policy"] != "fixed 1"]
    text = serve_section(run, "dspark bench serve", {"pareto": "p.png", "cost": "c.png"}, "serve-short")
    assert text.startswith("## serve-short") and "1.3x fixed 1: not measured" in text
    plots = serve_plots(run, tmp_path / "plots", "serve-short")
    assert all(p.stat().st_size > 1000 and p.name.startswith("serve-short-") for p in plots.values())


def test_matched_throughput_interpolates_along_the_baseline():
    from dspark.bench.serve import matched_throughput, mean_interval

    summary = [
        {"policy": "plain", "concurrency": 1, "aggregate_tps": 30.0, "per_user_tps": 30.0},
        {"policy": "plain", "concurrency": 2, "aggregate_tps": 50.0, "per_user_tps": 25.0},
        {"policy": "fast", "concurrency": 1, "aggregate_tps": 40.0, "per_user_tps": 40.0},  # plain at 40: 27.5
        {"policy": "fast", "concurrency": 2, "aggregate_tps": 20.0, "per_user_tps": 20.0},  # below: plain's 1 stream
        {"policy": "fast", "concurrency": 4, "aggregate_tps": 90.0, "per_user_tps": 22.0},  # plain never gets there
    ]
    assert matched_throughput(summary, "fast", "plain") == {1: pytest.approx(40 / 27.5, abs=1e-3), 2: 0.667, 4: None}
    # A baseline whose throughput falls again past 16 streams passes 96 tokens/s twice: between 8 and 16 streams
    # (13 -> 8 tokens/s a user) and between 16 and 32 (8 -> 4); the policy is measured against the better pass.
    saturating = [
        {"policy": "plain", "concurrency": c, "aggregate_tps": a, "per_user_tps": u}
        for c, a, u in ((1, 40.0, 40.0), (8, 94.0, 13.0), (16, 102.0, 8.0), (32, 95.0, 4.0))
    ] + [{"policy": "fast", "concurrency": 16, "aggregate_tps": 96.0, "per_user_tps": 7.0}]
    assert matched_throughput(saturating, "fast", "plain") == {16: pytest.approx(7 / (13 - 5 * 2 / 8), abs=1e-3)}
    assert mean_interval([10.0]) == (10.0, None)
    mean, half = mean_interval([9.0, 10.0, 11.0])
    assert mean == 10.0 and half == pytest.approx(4.303 / 3**0.5)


def test_stop_strings_cut_the_text_and_streamed_usage_is_exact(tiny):
    target, drafter = tiny
    app = create_app(SpeculativeEngine(target, drafter), target.tokenizer, ServeConfig("tiny"))
    messages = [{"role": "user", "content": words(6)}]
    full, count = plain_text(target, messages, 24)
    stop = full.split()[3]  # a word the answer contains: the text must end right before its first occurrence
    with LiveServer(app) as server:
        client = server.client()
        cut = client.chat.completions.create(model="tiny", messages=messages, max_tokens=24, temperature=0, stop=[stop])
        assert cut.choices[0].message.content == full[: full.index(stop)] and cut.choices[0].finish_reason == "stop"
        chunks = list(
            client.completions.create(
                model="tiny",
                prompt=words(6),
                max_tokens=10,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
            )
        )
        whole = client.completions.create(model="tiny", prompt=words(6), max_tokens=10, temperature=0)
        assert "".join(c.choices[0].text for c in chunks[:-1]) == whole.choices[0].text
        assert chunks[-1].choices == [] and all(c.usage is None for c in chunks[:-1])  # OpenAI's shape
        assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
        assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens == len(target.encode_text(words(6)))


class PoisonEngine(SpeculativeEngine):
    """Fails the prefill of any request whose prompt holds token 49 (t49), as a bug triggered by one input would."""

    def admit(self, batch, requests, *args, **kwargs):
        if any(49 in r.prompt for r in requests):
            raise RuntimeError("poisoned prompt")
        return super().admit(batch, requests, *args, **kwargs)


def test_a_failing_request_takes_nothing_else_down(tiny):
    target, drafter = tiny
    app = create_app(PoisonEngine(target, drafter), target.tokenizer, ServeConfig("tiny"))
    messages = [{"role": "user", "content": words(6)}]
    expected, _ = plain_text(target, messages, 12)
    with LiveServer(app) as server:
        client = server.client()
        bad = httpx.post(
            server.url + "/v1/chat/completions",
            timeout=30,
            json={"model": "tiny", "messages": [{"role": "user", "content": "t49 t50"}], "max_tokens": 4},
        )
        assert bad.status_code == 500 and "poisoned prompt" in bad.json()["error"]["message"]
        good = client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0)
        assert good.choices[0].message.content == expected
        assert server.metric('dspark_requests_total{reason="error"}') == 1


# ---- every field checked at the edge, every error in the OpenAI shape ----------------------------------------------
def test_fields_are_validated_at_the_edge_with_openai_errors(tiny):
    import socket

    target, drafter = tiny
    config = ServeConfig("tiny", max_tokens_limit=64, body_timeout_seconds=1.0)
    app = create_app(SpeculativeEngine(target, drafter), target.tokenizer, config)
    good = {"model": "tiny", "messages": [{"role": "user", "content": words(4)}], "max_tokens": 4}
    with LiveServer(app) as server:

        def post(body=None, raw=None, path="/v1/chat/completions"):
            return httpx.post(
                server.url + path,
                headers={"Content-Type": "application/json"},
                timeout=30,
                content=raw if raw is not None else json.dumps(body),
            )

        cases = [  # (response, status, words the message must hold, param)
            (post(dict(good, seed=2**64)), 400, "less than or equal", "seed"),
            (post(dict(good, seed=-1)), 400, "greater than or equal", "seed"),
            (post(dict(good, max_tokens=True)), 400, "valid integer", "max_tokens"),
            (post(dict(good, top_k=10**30)), 400, "less than or equal", "top_k"),
            (
                post(dict(good, tools=[{"type": "function", "function": {"name": "f"}}])),
                400,
                "'tools' is not supported",
                "tools",
            ),
            (post(dict(good, response_format={"type": "json_object"})), 400, "not supported", "response_format"),
            (post(dict(good, frobnicate=1)), 400, "unrecognized request argument", "frobnicate"),
            (post(dict(good, presence_penalty=0.5)), 400, "not supported", "presence_penalty"),
            (post(dict(good, messages=[{"role": "tool", "content": "x"}])), 400, "", "messages.0.role"),
            (post(dict(good, top_logprobs=2)), 400, "needs logprobs", "top_logprobs"),
            (
                post(dict(good, max_tokens=50, max_completion_tokens=100)),
                400,
                "max_completion_tokens must be",
                "max_completion_tokens",
            ),
            (
                post(raw='{"model": "tiny", "messages": [{"role": "user", "content": "\\ud800 t5"}]}'),
                400,
                "not valid UTF-8",
                "messages",
            ),
            (post(raw=b'{"model": "tiny", "messages": [{"role": "user", "content": "\xff\xfe"}]}'), 400, "", None),
            (post(raw="[" * 100_000 + "]" * 100_000), 400, "", None),
            (post(raw='{"model": "tiny", "messages": [}'), 400, "not valid JSON", None),
            (
                post({"model": "tiny", "prompt": words(1000), "max_tokens": 60}, path="/v1/completions"),
                400,
                "context window",
                "prompt",
            ),
        ]
        for response, status, message, param in cases:
            assert response.status_code == status, response.text
            error = response.json()["error"]
            assert message in error["message"] and error["param"] == param, error
        # max_completion_tokens wins over max_tokens, as in the OpenAI API
        both = post(dict(good, max_tokens=2, max_completion_tokens=6, temperature=0)).json()
        assert both["usage"]["completion_tokens"] == 6 or both["choices"][0]["finish_reason"] == "stop"
        # a body shorter than its Content-Length is answered 408 once the body timeout passes
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
            sock.sendall(
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b'Content-Length: 500\r\n\r\n{"model": '
            )
            started = time.monotonic()
            reply = b""
            while b"request_timeout" not in reply and (chunk := sock.recv(4096)):  # headers and body may part
                reply += chunk
            reply = reply.decode()
            assert reply.startswith("HTTP/1.1 408") and "request_timeout" in reply
            assert time.monotonic() - started < 5
        assert post(good).status_code == 200  # and the server goes on


class PoisonRoundEngine(SpeculativeEngine):
    """A round fails whenever a row whose prompt holds token 49 (t49) is in it, as a bug triggered by one request's
    input would; the admission works, so the failure happens inside rounds shared with other requests."""

    def step(self, batch, *args, **kwargs):
        if any(49 in row.request.prompt for row in batch.rows):
            raise RuntimeError("poisoned round")
        return super().step(batch, *args, **kwargs)


def test_a_failure_inside_a_round_fails_only_its_request(tiny):
    target, drafter = tiny
    engine = PoisonRoundEngine(target, drafter)
    app = create_app(engine, target.tokenizer, ServeConfig("tiny"))
    prompts = [[{"role": "user", "content": words(5, start=s)}] for s in (5, 12, 20)]
    expected = [plain_text(target, p, 16)[0] for p in prompts]
    with LiveServer(app) as server:
        client = server.client()

        def ask(messages):
            try:
                return (
                    client.chat.completions.create(model="tiny", messages=messages, max_tokens=16, temperature=0)
                    .choices[0]
                    .message.content
                )
            except openai.InternalServerError as e:
                return e

        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(ask, prompts + [[{"role": "user", "content": "t49 t50 t51"}]] + prompts))
    assert answers[:3] == expected and answers[4:] == expected
    assert isinstance(answers[3], openai.InternalServerError) and "poisoned round" in str(answers[3])


def test_logprobs_come_from_the_target_through_the_openai_client(tiny):
    import math

    target, drafter = tiny
    app = create_app(SpeculativeEngine(target, drafter), target.tokenizer, ServeConfig("tiny"))
    messages = [{"role": "user", "content": words(6)}]
    expected, count = plain_text(target, messages, 12)
    with LiveServer(app) as server:
        client = server.client()
        reply = client.chat.completions.create(
            model="tiny", messages=messages, max_tokens=12, temperature=0, logprobs=True, top_logprobs=3
        )
        entries = reply.choices[0].logprobs.content
        assert len(entries) == reply.usage.completion_tokens == count
        for e in entries:  # greedy: each token is the target's argmax, so it heads its own top list
            assert len(e.top_logprobs) == 3 and e.logprob <= 0
            assert e.top_logprobs[0].token == e.token and math.isclose(e.top_logprobs[0].logprob, e.logprob)
        # the same numbers as the target's own forward over prompt + answer
        ids = target.encode_chat(messages)
        answer = generate_plain(target, [ids], 12)[0].token_ids
        import torch

        full = torch.tensor([ids + answer])
        logp = torch.log_softmax(target.forward_sequences(full).logits[0, len(ids) - 1 : -1].float(), -1)
        direct = [logp[j, t].item() for j, t in enumerate(answer)]
        assert [e.logprob for e in entries] == pytest.approx(direct, abs=1e-4)
        streamed = [
            c.choices[0].logprobs
            for c in client.chat.completions.create(
                model="tiny", messages=messages, max_tokens=12, temperature=0, logprobs=True, stream=True
            )
            if c.choices and c.choices[0].logprobs
        ]
        assert [e.logprob for c in streamed for e in c.content] == pytest.approx(direct, abs=1e-4)
        legacy = client.completions.create(model="tiny", prompt=words(6), max_tokens=5, temperature=0, logprobs=2)
        lp = legacy.choices[0].logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == legacy.usage.completion_tokens
        assert all(len(top) == 2 for top in lp.top_logprobs)
        plain = client.chat.completions.create(model="tiny", messages=messages, max_tokens=4, temperature=0)
        assert plain.choices[0].logprobs is None


class EndlessTarget(Target):
    """The tiny target with no stop token: an answer runs to max_tokens."""

    stop_token_ids = frozenset()


def test_shutdown_ends_a_long_stream_within_the_drain_time(tiny):
    target, drafter = tiny
    endless = EndlessTarget(target.model, target.tokenizer, target.name, target.layer_ids)
    app = create_app(
        SlowEngine(endless, drafter), target.tokenizer, ServeConfig("tiny", max_tokens_limit=1000, drain_seconds=1.0)
    )
    server = LiveServer(app, drain_seconds=1.0).__enter__()
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": words(4)}],
        "max_tokens": 900,
        "temperature": 0.8,
        "stream": True,
    }
    lines = []
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=60) as r:
        events = r.iter_lines()
        while len(lines) < 3:
            lines.append(next(events))
        started = time.monotonic()
        stopper = threading.Thread(target=server.__exit__, args=(None, None, None))
        stopper.start()
        lines += list(events)
    stopper.join(timeout=30)
    assert not stopper.is_alive() and time.monotonic() - started < 8
    data = [line for line in lines if line.startswith("data: ")]
    assert data[-1] == "data: [DONE]" and "shut down" in data[-2]


def test_a_request_during_the_drain_gets_503_not_a_refused_connection(tiny):
    target, drafter = tiny
    endless = EndlessTarget(target.model, target.tokenizer, target.name, target.layer_ids)
    config = ServeConfig("tiny", max_tokens_limit=1000, drain_seconds=2.0)
    server = LiveServer(create_app(SlowEngine(endless, drafter), target.tokenizer, config), drain_seconds=2.0)
    server.__enter__()
    body = {"model": "tiny", "messages": [{"role": "user", "content": words(4)}], "max_tokens": 900, "stream": True}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        next(lines)
        stopper = threading.Thread(target=server.__exit__, args=(None, None, None))
        stopper.start()
        time.sleep(0.3)
        late = httpx.post(server.url + "/v1/chat/completions", json=dict(body, stream=False), timeout=10)
        assert late.status_code == 503 and "shutting down" in late.json()["error"]["message"]
        rest = [line for line in lines if line.startswith("data: ")]
    stopper.join(timeout=30)
    assert not stopper.is_alive() and rest[-1] == "data: [DONE]" and "shut down" in rest[-2]


def test_headers_that_trickle_are_cut_off(tiny, monkeypatch):
    import socket

    from dspark.serve import local

    monkeypatch.setattr(local, "HEADER_SECONDS", 0.5)
    target, drafter = tiny
    with LiveServer(create_app(SpeculativeEngine(target, drafter), target.tokenizer, ServeConfig("tiny"))) as server:
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as conn:
            started = time.monotonic()
            try:
                for byte in b"GET /health HTTP/1.1\r\nHost: x\r\n":
                    conn.sendall(bytes([byte]))
                    time.sleep(0.1)
                closed = conn.recv(1) == b""
            except (BrokenPipeError, ConnectionResetError):
                closed = True
            assert closed and time.monotonic() - started < 5
        assert httpx.get(server.url + "/health").status_code == 200  # the server itself goes on


@pytest.mark.real
def test_a_reply_cut_inside_a_character_holds_the_partial_character_back(real_target):
    from dspark.serve.app import TextPieces

    tok = real_target.tokenizer
    ids = tok.encode("ok 😀", add_special_tokens=False)
    cut = ids[:-1]  # the emoji's bytes span several tokens: stop after the first of them
    assert tok.decode(cut).endswith("\ufffd")
    pieces = TextPieces(tok, [])
    pieces.add(cut)
    assert pieces.flush() == "ok " and "\ufffd" not in pieces.text


def sse_events(response) -> list[dict]:
    """The JSON events of a server-sent stream, [DONE] checked last and left out."""
    lines = [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_the_request_shapes_real_clients_send(tiny):
    """Content as text parts, prompts as lists of strings or token ids, ignore_eos, min_tokens,
    and the usage options: each answered 200 and with what the plain shape gives; what cannot be honoured is refused
    by name."""
    target, drafter = tiny
    app = create_app(SpeculativeEngine(target, drafter), target.tokenizer, ServeConfig("tiny"))
    messages = [{"role": "user", "content": words(6)}]
    with LiveServer(app) as server:

        def post(path, **body):
            return httpx.post(server.url + path, json={"model": "tiny", "temperature": 0, **body}, timeout=60)

        plain = post("/v1/chat/completions", messages=messages, max_tokens=12).json()["choices"][0]["message"]
        parts = [{"role": "user", "content": [{"type": "text", "text": words(6)}]}]
        reply = post("/v1/chat/completions", messages=parts, max_tokens=12, min_tokens=0)
        assert reply.status_code == 200 and reply.json()["choices"][0]["message"] == plain
        two = [{"role": "user", "content": [{"type": "text", "text": "t5"}, {"type": "text", "text": "t6"}]}]
        joined = [{"role": "user", "content": "t5\nt6"}]
        assert (
            post("/v1/chat/completions", messages=two, max_tokens=6).json()["choices"][0]["message"]
            == post("/v1/chat/completions", messages=joined, max_tokens=6).json()["choices"][0]["message"]
        )
        image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}]
        refusal = post("/v1/chat/completions", messages=image, max_tokens=4)
        assert refusal.status_code == 400 and "'image_url' is not supported" in refusal.json()["error"]["message"]
        refusal = post("/v1/chat/completions", messages=messages, max_tokens=4, min_tokens=5)
        assert refusal.status_code == 400 and "min_tokens" in refusal.json()["error"]["message"]
        # min_tokens: the reply that stopped early goes on, through the stop token it would have ended with
        short = post("/v1/completions", prompt=words(2, start=19), max_tokens=60).json()  # stops after 16 tokens
        n = short["usage"]["completion_tokens"]
        assert short["choices"][0]["finish_reason"] == "stop" and n < 50, short
        held = post("/v1/completions", prompt=words(2, start=19), max_tokens=60, min_tokens=n + 5).json()
        assert held["usage"]["completion_tokens"] >= n + 5
        assert held["choices"][0]["text"].startswith(short["choices"][0]["text"])
        # and a stop string is looked for only after the text of the first min_tokens tokens
        text = post("/v1/completions", prompt=words(6), max_tokens=20).json()["choices"][0]["text"]
        stop = " " + text.split()[2] + " "
        cut = post("/v1/completions", prompt=words(6), max_tokens=20, stop=stop).json()["choices"][0]["text"]
        late = post("/v1/completions", prompt=words(6), max_tokens=20, stop=stop, min_tokens=20).json()
        assert len(cut) < len(text) and late["choices"][0]["text"] == text

        # prompts: a list of strings is one choice per prompt, token ids are read as they are
        prompts = [words(4), words(5, start=20), words(3, start=9)]
        alone = [post("/v1/completions", prompt=p, max_tokens=8).json()["choices"][0]["text"] for p in prompts]
        batch = post("/v1/completions", prompt=prompts, max_tokens=8).json()
        assert [c["index"] for c in batch["choices"]] == [0, 1, 2] and [c["text"] for c in batch["choices"]] == alone
        ids = [target.encode_text(p) for p in prompts]
        assert post("/v1/completions", prompt=ids[0], max_tokens=8).json()["choices"][0]["text"] == alone[0]
        assert [c["text"] for c in post("/v1/completions", prompt=ids, max_tokens=8).json()["choices"]] == alone
        assert batch["usage"]["prompt_tokens"] == sum(map(len, ids))
        with httpx.stream(
            "POST",
            server.url + "/v1/completions",
            json={"model": "tiny", "prompt": prompts, "max_tokens": 8, "temperature": 0, "stream": True},
            timeout=60,
        ) as r:
            events = sse_events(r)
        texts = ["".join(e["choices"][0]["text"] for e in events if e["choices"][0]["index"] == i) for i in range(3)]
        assert texts == alone and all("usage" not in e for e in events)  # usage only when asked for
        for bad in ([], [[]], [1, "a"], [target.vocab_size]):
            assert post("/v1/completions", prompt=bad, max_tokens=4).status_code == 400

        # ignore_eos: to max_tokens through stop tokens
        long = post("/v1/completions", prompt=words(6), max_tokens=60, ignore_eos=True).json()
        assert long["usage"]["completion_tokens"] == 60 and long["choices"][0]["finish_reason"] == "length"

        # usage: off, at the end in OpenAI's shape, or on every chunk (vLLM's continuous_usage_stats)
        for options in ({"include_usage": False}, {"include_usage": True, "continuous_usage_stats": True}):
            with httpx.stream(
                "POST",
                server.url + "/v1/chat/completions",
                json={
                    "model": "tiny",
                    "messages": messages,
                    "max_tokens": 12,
                    "temperature": 0,
                    "stream": True,
                    "stream_options": options,
                },
                timeout=60,
            ) as r:
                events = sse_events(r)
            text = "".join(e["choices"][0]["delta"].get("content", "") for e in events if e["choices"])
            assert text == plain["content"]
            if options["include_usage"]:
                assert events[-1]["choices"] == [] and all(e["usage"] for e in events)
                counts = [e["usage"]["completion_tokens"] for e in events]
                assert counts == sorted(counts) and counts[-1] == events[-1]["usage"]["completion_tokens"] > 0
            else:
                assert all("usage" not in e for e in events)


@pytest.mark.parametrize("speculative", [False, True])
def test_guidellm_request_shapes_stream_against_plain_and_speculative_servers(tiny, speculative):
    """The body guidellm 0.8 streams (text parts, ignore_eos, continuous usage), at 1 and 4 concurrent streams: every
    request answered, with the same greedy text from the plain and the speculative server."""
    target, drafter = tiny
    engine = SpeculativeEngine(target, drafter if speculative else None)
    app = create_app(engine, target.tokenizer, ServeConfig("tiny"))
    prompts = [words(8, start=5 + i) for i in range(8)]
    expected = [
        target.tokenizer.decode(
            generate_plain(target, [target.encode_chat([{"role": "user", "content": p}])], 16, stop_token_ids=set())[
                0
            ].token_ids,
            skip_special_tokens=True,
        )
        for p in prompts
    ]
    with LiveServer(app) as server:

        def one(prompt):
            body = {
                "model": "tiny",
                "messages": [{"role": "user", "content": [{"type": "text", "text": prompt}]}],
                "max_tokens": 16,
                "max_completion_tokens": 16,
                "ignore_eos": True,
                "temperature": 0,
                "stream": True,
                "stream_options": {"include_usage": True, "continuous_usage_stats": True},
            }
            with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=60) as r:
                assert r.status_code == 200
                events = sse_events(r)
            assert events[-1]["usage"]["completion_tokens"] == 16
            return "".join(e["choices"][0]["delta"].get("content", "") for e in events if e["choices"])

        for streams in (1, 4):
            with ThreadPoolExecutor(streams) as pool:
                assert list(pool.map(one, prompts)) == expected
