"""`dspark serve`: an OpenAI-compatible HTTP API over the engine loop.

/v1/chat/completions and /v1/completions (streamed as server-sent events, `data: [DONE]` last, or whole),
/v1/models, /health, /metrics. Every field is checked at the edge; every error, whatever raised it, is OpenAI-style
JSON ({"error": {"message", "type", "param", "code"}}) with the status a client expects: 400 bad request (including
fields this server does not support: it never ignores one silently), 401 wrong or missing API key, 404 unknown
model, 408 a body that did not arrive in time, 411 a body without Content-Length, 413 body too large, 429 too many
requests in flight, 503 shutting down. Nothing here knows how decoding works: it validates, encodes, submits to the
loop and turns tokens into text.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass
from itertools import count
from typing import Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, field_validator
from starlette.exceptions import HTTPException as StarletteHTTPException

from dspark.decoding.requests import RequestState, TokenLogprob
from dspark.errors import DSparkError
from dspark.sampling import MAX_SEED, SamplingParams
from dspark.serve.batcher import EngineLoop, Submission
from dspark.serve.metrics import ServerMetrics


@dataclass
class ServeConfig:
    model_name: str
    api_key: str | None = None
    max_batch: int = 32  # rows decoding together
    max_concurrent: int = 64  # requests admitted or waiting; more are answered 429
    max_tokens_limit: int = 2048  # the largest max_tokens a request may ask for
    default_max_tokens: int = 256
    max_body_bytes: int = 1 << 20
    body_timeout_seconds: float = 10.0  # a request body must arrive whole within this
    drain_seconds: float = 10.0  # graceful shutdown: in-flight requests get this long to finish


MAX_TOP_LOGPROBS = 20  # as the OpenAI API
MAX_STOPS = 4


class Strict(BaseModel):
    # A field this server does not know is refused (as the OpenAI API does), never silently ignored.
    model_config = ConfigDict(extra="forbid")


class ChatMessage(Strict):
    role: Literal["system", "user", "assistant"]
    content: str  # or a list of text parts, joined with newlines (as vLLM joins them)
    name: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def text_of_parts(cls, content):
        if not isinstance(content, list):
            return content
        texts = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            if kind != "text" or not isinstance(part.get("text"), str) or set(part) != {"type", "text"}:
                raise ValueError(
                    f"a content part of type {kind!r} is not supported by this server; send text parts "
                    '({"type": "text", "text": ...}) or a string'
                )
            texts.append(part["text"])
        return "\n".join(texts)


class StreamOptions(Strict):
    include_usage: StrictBool = False  # a last chunk with the request's usage and no choices, as OpenAI sends it
    continuous_usage_stats: StrictBool = False  # usage so far on every chunk (vLLM's extension)


class GenerationBody(Strict):
    model: str
    max_tokens: StrictInt | None = None
    max_completion_tokens: StrictInt | None = None
    temperature: float = Field(1.0, ge=0.0, le=100.0, allow_inf_nan=False)
    top_p: float = Field(1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: StrictInt = Field(0, ge=0, le=1 << 20)
    seed: StrictInt | None = Field(None, ge=0, le=MAX_SEED)
    stop: str | list[str] | None = Field(None)
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    n: StrictInt = Field(1, ge=1, le=1)
    user: str | None = None
    ignore_eos: StrictBool = False  # vLLM's extension: generate to max_tokens through stop tokens (benchmarks)
    # vLLM's extension: no stop token or stop string before this many tokens (in plain and speculative decoding alike)
    min_tokens: StrictInt = Field(0, ge=0)
    # Accepted at their neutral values only: anything else would change the output in a way this server does not.
    presence_penalty: float = Field(0.0, ge=0.0, le=0.0)
    frequency_penalty: float = Field(0.0, ge=0.0, le=0.0)
    logit_bias: dict[str, float] | None = Field(None, max_length=0)

    @field_validator("stop")
    @classmethod
    def few_stops(cls, stop):
        if isinstance(stop, list) and len(stop) > MAX_STOPS:
            raise ValueError(f"at most {MAX_STOPS} stop strings")
        return stop


class ChatBody(GenerationBody):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)


class CompletionBody(GenerationBody):
    prompt: str | list  # a string, a list of strings (one choice each), token ids, or a list of token-id lists
    logprobs: StrictInt | None = Field(None, ge=0, le=5)  # the legacy API: the count of alternatives
    echo: Literal[False] = False
    best_of: StrictInt = Field(1, ge=1, le=1)

    @field_validator("prompt")
    @classmethod
    def prompt_shape(cls, prompt):
        def ids(p) -> bool:
            return isinstance(p, list) and bool(p) and all(type(t) is int for t in p)

        if isinstance(prompt, str) or (
            prompt and (all(isinstance(p, str) for p in prompt) or ids(prompt) or all(ids(p) for p in prompt))
        ):
            return prompt
        raise ValueError(
            "prompt must be a string, a list of strings, a list of token ids, or a list of token-id lists (none empty)"
        )


# Fields of the OpenAI API this server does not implement: refused by name with a 400 that says so.
UNSUPPORTED = (
    "tools",
    "tool_choice",
    "functions",
    "function_call",
    "parallel_tool_calls",
    "response_format",
    "audio",
    "modalities",
    "prediction",
    "web_search_options",
    "suffix",
)


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        kind: str = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.kind, self.code, self.param = status, message, kind, code, param

    def response(self) -> JSONResponse:
        return JSONResponse(
            {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}},
            status_code=self.status,
        )


def create_app(engine, tokenizer, config: ServeConfig) -> FastAPI:
    metrics = ServerMetrics(engine.gamma)
    loop_ = EngineLoop(engine, config.max_batch, metrics)
    ids = count()
    state = {"accepting": True}

    @asynccontextmanager
    async def lifespan(_app):
        loop_.start()
        yield
        begin_shutdown()  # where the server did not call it first (DrainingServer does)
        await asyncio.to_thread(loop_.stop)

    def begin_shutdown() -> None:
        """New requests get 503; those in flight get `drain_seconds` to finish, then end with an error they can
        read (a streamed one: an error event and [DONE])."""
        if state["accepting"]:
            state["accepting"] = False
            loop_.close_after(config.drain_seconds)

    app = FastAPI(title="dspark", lifespan=lifespan)
    app.state.engine_loop, app.state.metrics, app.state.begin_shutdown = loop_, metrics, begin_shutdown
    app.state.in_flight, app.state.drain_seconds = loop_.load, config.drain_seconds

    answer_errors_in_openai_shape(app)
    guard_requests(app, config)

    @app.get("/health")
    async def health():
        return {"status": "ok" if state["accepting"] else "shutting down", "active": loop_.load()}

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.text(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models():
        return {
            "object": "list",
            "data": [{"id": config.model_name, "object": "model", "created": 0, "owned_by": "dspark"}],
        }

    completions = Completions(loop_, tokenizer, config, engine.target, next_id=lambda: next(ids))

    def accepting() -> None:
        if not state["accepting"]:
            raise ApiError(503, "the server is shutting down", "server_error")

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatBody):
        accepting()
        messages = [{"role": m.role, "content": m.content} for m in body.messages]
        if body.top_logprobs is not None and not body.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        try:
            prompt = engine.target.encode_chat(messages)
        except DSparkError as e:
            raise ApiError(400, str(e), param="messages") from e
        top_logprobs = (body.top_logprobs or 0) if body.logprobs else None
        return await completions.respond(body, [prompt], chat=True, top_logprobs=top_logprobs)

    @app.post("/v1/completions")
    async def text_completions(body: CompletionBody):
        accepting()
        return await completions.respond(body, prompt_ids(engine.target, body.prompt), False, body.logprobs)

    return app


def answer_errors_in_openai_shape(app: FastAPI) -> None:
    """Every error, whatever raised it, as OpenAI-style JSON with the status a client expects."""

    @app.exception_handler(ApiError)
    async def api_error(_request, e: ApiError):
        return e.response()

    @app.exception_handler(RequestValidationError)
    async def invalid(_request, e: RequestValidationError):
        return validation_error(e.errors()).response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_request, e: StarletteHTTPException):
        message = e.detail if isinstance(e.detail, str) else "bad request"
        if e.status_code == 400 and "parsing the body" in message:
            message = "the request body is not valid JSON (or is not UTF-8, or nests too deeply)"
        return ApiError(
            e.status_code, message, "invalid_request_error" if e.status_code < 500 else "server_error"
        ).response()

    @app.exception_handler(Exception)
    async def unexpected(_request, e: Exception):  # the last line of defence: still the OpenAI shape
        return ApiError(500, f"internal error: {type(e).__name__}", "server_error").response()


def guard_requests(app: FastAPI, config: ServeConfig) -> None:
    """The API key, Content-Length and body limits, checked before the app reads a body."""

    # Middleware added last runs first: the guard refuses a client without the key (or with a body too large)
    # before WholeBody reads any of its body.
    app.add_middleware(WholeBody, seconds=config.body_timeout_seconds, limit=config.max_body_bytes)

    @app.middleware("http")
    async def guard(request: Request, call_next):
        if request.url.path.startswith("/v1/"):
            if config.api_key and request.headers.get("authorization") != f"Bearer {config.api_key}":
                return ApiError(
                    401,
                    "invalid or missing API key (send 'Authorization: Bearer KEY')",
                    "authentication_error",
                    "invalid_api_key",
                ).response()
            size = request.headers.get("content-length")
            if request.method == "POST" and size is None:  # a body of unknown length could be any size
                return ApiError(
                    411, "send the request body with a Content-Length header", code="length_required"
                ).response()
            if size is not None and size.isdigit() and int(size) > config.max_body_bytes:
                return ApiError(
                    413,
                    f"request body of {size} bytes is over the limit of {config.max_body_bytes}",
                    code="request_too_large",
                ).response()
        return await call_next(request)


def prompt_ids(target, prompt: str | list) -> list[list[int]]:
    """Each prompt of a completions request as token ids: strings encoded, token ids checked against the vocabulary."""
    if isinstance(prompt, str) or isinstance(prompt[0], str):
        try:
            return [target.encode_text(text) for text in ([prompt] if isinstance(prompt, str) else prompt)]
        except DSparkError as e:
            raise ApiError(400, str(e), param="prompt") from e
    prompts = [prompt] if isinstance(prompt[0], int) else prompt
    bad = next((t for p in prompts for t in p if not 0 <= t < target.vocab_size), None)
    if bad is not None:
        raise ApiError(400, f"token id {bad} is outside the vocabulary (0 to {target.vocab_size - 1})", param="prompt")
    return prompts


class Completions:
    """Validated requests to the engine loop and back as OpenAI responses, whole or streamed; one choice per prompt."""

    def __init__(self, loop_: EngineLoop, tokenizer, config: ServeConfig, target, next_id):
        self.loop, self.tokenizer, self.config, self.next_id = loop_, tokenizer, config, next_id
        self.window, self.stop_ids = target.context_window, target.stop_token_ids

    def max_tokens(self, body: GenerationBody) -> tuple[str, int | None]:
        """The field that sets the length, and its value: max_completion_tokens replaces the older max_tokens, and
        wins where both are given (as in the OpenAI API)."""
        field, wanted = next(
            ((f, getattr(body, f)) for f in ("max_completion_tokens", "max_tokens") if getattr(body, f) is not None),
            ("max_tokens", None),
        )
        if wanted is not None and not 1 <= wanted <= self.config.max_tokens_limit:
            raise ApiError(
                400, f"{field} must be between 1 and {self.config.max_tokens_limit}, got {wanted}", param=field
            )
        return field, wanted

    def prepare(self, body: GenerationBody, prompt: list[int], top_logprobs: int | None) -> Submission:
        """A request the engine loop can take, or the 4xx that says why not."""
        if body.model != self.config.model_name:
            raise ApiError(
                404,
                f"model '{body.model}' is not served here; this server serves '{self.config.model_name}'",
                code="model_not_found",
                param="model",
            )
        field, wanted = self.max_tokens(body)
        room = (self.window or 1 << 62) - len(prompt)
        if room <= 0 or (wanted is not None and wanted > room):
            asked = f" + {field} {wanted}" if wanted is not None else ""
            raise ApiError(
                400,
                f"the prompt has {len(prompt)} tokens{asked}, over this model's context window of "
                f"{self.window} tokens; shorten the prompt{' or lower ' + field if wanted else ''}",
                code="context_length_exceeded",
                param="messages" if isinstance(body, ChatBody) else "prompt",
            )
        stops = set() if body.ignore_eos else self.stop_ids
        try:
            request = RequestState(
                self.next_id(),
                prompt,
                wanted or self.config.default_max_tokens,
                stops,
                self.window,
                top_logprobs,
                min_tokens=body.min_tokens,
            )
            sampling = SamplingParams(body.temperature, body.top_k, body.top_p, body.seed)
        except DSparkError as e:
            raise ApiError(400, str(e)) from e
        return Submission(request, sampling, asyncio.get_running_loop())

    async def respond(self, body: GenerationBody, prompts: list[list[int]], chat: bool, top_logprobs: int | None):
        """Every prompt checked before any is submitted: one bad prompt refuses the request and runs nothing."""
        subs = [self.prepare(body, prompt, top_logprobs) for prompt in prompts]
        if self.loop.load() + len(subs) > self.config.max_concurrent:
            raise ApiError(429, f"{self.config.max_concurrent} requests are in flight; retry later", "rate_limit_error")
        for sub in subs:
            self.loop.submit(sub)
        stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        pieces = [TextPieces(self.tokenizer, stops, body.min_tokens) for _ in subs]
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        if body.stream:
            events = self.stream(subs, pieces, rid, chat, body)
            return StreamingResponse(events, media_type="text/event-stream")
        try:
            outcomes = await asyncio.gather(*(self.collect(sub, text) for sub, text in zip(subs, pieces)))
        finally:
            self.cancel_unfinished(subs)
        reasons = [reason for reason, _ in outcomes]
        if "error" in reasons:
            raise ApiError(500, f"generation failed: {outcomes[reasons.index('error')][1]}", "server_error")
        if "shutdown" in reasons:
            raise ApiError(503, "the server shut down before this request finished; retry", "server_error")
        choices = []
        for i, (sub, text, reason) in enumerate(zip(subs, pieces, reasons)):
            entries = sub.request.logprobs[: text.tokens]
            logprobs = render_logprobs(self.tokenizer, entries, chat) if top_logprobs is not None else None
            choice = {"index": i, "finish_reason": finish_reason(reason), "logprobs": logprobs}
            choice.update({"message": {"role": "assistant", "content": text.text}} if chat else {"text": text.text})
            choices.append(choice)
        return {
            "id": rid,
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": body.model,
            "choices": choices,
            "usage": total_usage(subs, pieces),
        }

    def cancel_unfinished(self, subs: list[Submission]) -> None:
        for sub in subs:
            if not sub.request.finished:
                self.loop.cancel(sub.request.index)

    async def collect(self, sub: Submission, pieces: TextPieces):
        while True:
            event = await sub.events.get()
            if event[0] == "done":
                pieces.flush()
                return event[1], event[2]
            if pieces.add(event[1]):  # a stop string: the rest is not wanted
                self.loop.cancel(sub.request.index)
                return "stop", None

    async def stream(self, subs: list[Submission], pieces: list[TextPieces], rid: str, chat: bool, body):
        """Server-sent events of every choice as its tokens come, interleaved; then, where asked for, a last chunk
        with the usage and no choices (OpenAI's shape), and [DONE]."""
        options = body.stream_options or StreamOptions()
        continuous = options.include_usage and options.continuous_usage_stats  # as vLLM: both asked for
        created, sent = int(time.time()), [0] * len(subs)

        def event(choices: list, usage_=None) -> str:
            data = {
                "id": rid,
                "object": "chat.completion.chunk" if chat else "text_completion",
                "created": created,
                "model": body.model,
                "choices": choices,
            }
            if options.include_usage:
                data["usage"] = usage_
            return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"

        def chunk(i: int, delta: dict, reason=None) -> str:
            logprobs = None
            if subs[i].request.top_logprobs is not None and delta.get("content"):
                logprobs = render_logprobs(self.tokenizer, subs[i].request.logprobs[sent[i] : pieces[i].tokens], chat)
                sent[i] = pieces[i].tokens
            choice = {"index": i, "finish_reason": reason, "logprobs": logprobs}
            if chat:
                choice["delta"] = delta
            else:
                choice["text"] = delta.get("content", "")
            return event([choice], total_usage(subs, pieces) if continuous else None)

        waiting = {asyncio.ensure_future(sub.events.get()): i for i, sub in enumerate(subs)}
        try:
            if chat:
                for i in range(len(subs)):
                    yield chunk(i, {"role": "assistant", "content": ""})
            failed = None
            while waiting and failed is None:
                done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    i, (kind, *payload) = waiting.pop(task), task.result()
                    if kind == "done":
                        reason, tail = payload[0], pieces[i].flush()
                        if tail:
                            yield chunk(i, {"content": tail})
                    else:
                        before = len(pieces[i].text)
                        stopped = pieces[i].add(payload[0])
                        if len(pieces[i].text) > before:
                            yield chunk(i, {"content": pieces[i].text[before:]})
                        if not stopped:
                            waiting[asyncio.ensure_future(subs[i].events.get())] = i
                            continue
                        self.loop.cancel(subs[i].request.index)
                        reason = "stop"
                    if reason in ("error", "shutdown"):
                        failed = reason
                    else:
                        yield chunk(i, {}, finish_reason(reason))
            if failed:
                message = "generation failed" if failed == "error" else "the server shut down before this finished"
                yield f"data: {json.dumps({'error': {'message': message, 'type': 'server_error'}})}\n\n"
            elif options.include_usage:
                yield event([], total_usage(subs, pieces))
            yield "data: [DONE]\n\n"
        finally:  # the client went away (or we are done): its rows leave the batch
            for task in waiting:
                task.cancel()
            self.cancel_unfinished(subs)


class TextPieces:
    """The text of a growing token list, released only in whole characters and cut at the first stop string that
    starts after the text of the first `min_tokens` tokens."""

    def __init__(self, tokenizer, stops: list[str], min_tokens: int = 0):
        self.tokenizer, self.stops, self.min_tokens = tokenizer, [s for s in stops if s], min_tokens
        self.ids: list[int] = []
        self.text = ""
        self.tokens = 0
        self.free = 0 if not min_tokens else None  # where stop strings may start: known once min_tokens are out

    def add(self, tokens: list[int]) -> bool:
        """Take new tokens; True when a stop string was reached (the text then ends before it)."""
        self.ids += tokens
        self.tokens += len(tokens)
        full = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if self.free is None and self.tokens >= self.min_tokens:
            self.free = len(self.tokenizer.decode(self.ids[: self.min_tokens], skip_special_tokens=True))
        cuts = [full.find(s, self.free) for s in self.stops if self.free is not None and s in full[self.free :]]
        if cuts:
            self.text = full[: min(cuts)]
            return True
        if not full.endswith("\ufffd"):
            # hold back a tail that could still become a stop string
            hold = max((k for s in self.stops for k in range(1, len(s)) if full.endswith(s[:k])), default=0)
            self.text = full[: len(full) - hold]
        return False

    def flush(self) -> str:
        """At the end of generation: release what was held back, but not a character cut off half-way (a reply
        that ended inside a multi-byte character). Returns the newly released text."""
        before = len(self.text)
        self.text = self.tokenizer.decode(self.ids, skip_special_tokens=True).rstrip("\ufffd")
        return self.text[before:]


def validation_error(errors: list) -> ApiError:
    """One 400 for the first problem pydantic found, named by its field."""
    first = errors[0] if errors else {}
    loc = [str(x) for x in first.get("loc", ())[1:]]
    if first.get("type") == "json_invalid":
        return ApiError(400, "the request body is not valid JSON")
    where = ".".join(loc) or None
    if first.get("type") == "extra_forbidden" and loc:
        if loc[-1] in UNSUPPORTED:
            return ApiError(
                400, f"'{loc[-1]}' is not supported by this server", code="unsupported_parameter", param=where
            )
        return ApiError(400, f"unrecognized request argument: {where}", code="unknown_parameter", param=where)
    message = first.get("msg", "invalid request")
    if loc and loc[-1] in ("presence_penalty", "frequency_penalty", "logit_bias", "echo", "best_of"):
        message = f"{loc[-1]} is not supported by this server beyond its default"
    return ApiError(400, f"{message}{f' ({where})' if where else ''}", param=where)


def render_logprobs(tokenizer, entries: list[TokenLogprob], chat: bool) -> dict:
    """Log-probabilities in the OpenAI shapes: chat's `content` list, or the legacy completions columns."""

    def text(token: int) -> str:
        return tokenizer.decode([token])

    if chat:

        def item(token, logprob):
            piece = text(token)
            return {"token": piece, "logprob": logprob, "bytes": list(piece.encode("utf-8"))}

        return {
            "content": [dict(item(e.token, e.logprob), top_logprobs=[item(t, lp) for t, lp in e.top]) for e in entries]
        }
    return {
        "tokens": [text(e.token) for e in entries],
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [{text(t): lp for t, lp in e.top} for e in entries],
        "text_offset": [],
    }


class WholeBody:
    """ASGI middleware: a request's body is read whole before the app sees it, within `seconds` and `limit` bytes.
    A client that sends less than its Content-Length, or trickles, is answered 408 instead of holding a worker."""

    def __init__(self, app, seconds: float, limit: int):
        self.app, self.seconds, self.limit = app, seconds, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)

        async def read() -> bytes | None:
            chunks, size = [], 0
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    return None
                chunks.append(message.get("body", b""))
                size += len(chunks[-1])
                if size > self.limit:
                    raise OverflowError
                if not message.get("more_body"):
                    return b"".join(chunks)

        try:
            body = await asyncio.wait_for(read(), self.seconds)
        except asyncio.TimeoutError:
            return await ApiError(
                408, f"the request body did not arrive whole within {self.seconds:g} s", code="request_timeout"
            ).response()(scope, receive, send)
        except OverflowError:
            return await ApiError(
                413, f"request body over the limit of {self.limit} bytes", code="request_too_large"
            ).response()(scope, receive, send)
        if body is None:
            return None
        delivered = False

        async def replay():
            nonlocal delivered
            if delivered:
                return await receive()  # after the body: wait for the client to go away
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}

        return await self.app(scope, replay, send)


def finish_reason(reason: str) -> str:
    return {"stop": "stop", "length": "length", "cancelled": "stop"}.get(reason, reason)


def total_usage(subs: list[Submission], pieces: list[TextPieces]) -> dict:
    return usage(sum(len(sub.request.prompt) for sub in subs), sum(text.tokens for text in pieces))


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
