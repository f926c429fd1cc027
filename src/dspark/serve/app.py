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
    content: str
    name: str | None = None


class StreamOptions(Strict):
    include_usage: StrictBool = True  # usage is always sent with the last chunk


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
    prompt: str
    logprobs: StrictInt | None = Field(None, ge=0, le=5)  # the legacy API: the count of alternatives
    echo: Literal[False] = False
    best_of: StrictInt = Field(1, ge=1, le=1)


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
    window = engine.target.context_window
    stop_ids = engine.target.stop_token_ids

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

    def prepare(
        body: GenerationBody, prompt: list[int], top_logprobs: int | None
    ) -> tuple[RequestState, SamplingParams, list[str]]:
        if body.model != config.model_name:
            raise ApiError(
                404,
                f"model '{body.model}' is not served here; this server serves '{config.model_name}'",
                code="model_not_found",
                param="model",
            )
        if not state["accepting"]:
            raise ApiError(503, "the server is shutting down", "server_error")
        # max_completion_tokens replaces the older max_tokens, and wins where both are given (as in the OpenAI API)
        field, wanted = next(
            ((f, getattr(body, f)) for f in ("max_completion_tokens", "max_tokens") if getattr(body, f) is not None),
            ("max_tokens", None),
        )
        if wanted is not None and not 1 <= wanted <= config.max_tokens_limit:
            raise ApiError(400, f"{field} must be between 1 and {config.max_tokens_limit}, got {wanted}", param=field)
        room = (window or 1 << 62) - len(prompt)
        if room <= 0 or (wanted is not None and wanted > room):
            asked = f" + {field} {wanted}" if wanted is not None else ""
            raise ApiError(
                400,
                f"the prompt has {len(prompt)} tokens{asked}, over this model's context window of "
                f"{window} tokens; shorten the prompt{' or lower ' + field if wanted else ''}",
                code="context_length_exceeded",
                param="messages" if isinstance(body, ChatBody) else "prompt",
            )
        if loop_.load() >= config.max_concurrent:
            raise ApiError(429, f"{config.max_concurrent} requests are in flight; retry later", "rate_limit_error")
        stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        try:
            request = RequestState(
                next(ids), prompt, wanted or config.default_max_tokens, stop_ids, window, top_logprobs=top_logprobs
            )
            sampling = SamplingParams(body.temperature, body.top_k, body.top_p, body.seed)
        except DSparkError as e:
            raise ApiError(400, str(e)) from e
        return request, sampling, stops

    async def run(body: GenerationBody, prompt: list[int], chat: bool, top_logprobs: int | None):
        request, sampling, stops = prepare(body, prompt, top_logprobs)
        sub = Submission(request, sampling, asyncio.get_running_loop())
        loop_.submit(sub)
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        pieces = TextPieces(tokenizer, stops)
        if body.stream:
            return StreamingResponse(stream(sub, pieces, rid, chat, body.model), media_type="text/event-stream")
        try:
            reason, error = await collect(sub, pieces)
        finally:
            if not request.finished:
                loop_.cancel(request.index)
        if reason == "error":
            raise ApiError(500, f"generation failed: {error}", "server_error")
        if reason == "shutdown":
            raise ApiError(503, "the server shut down before this request finished; retry", "server_error")
        logprobs = (
            render_logprobs(tokenizer, request.logprobs[: pieces.tokens], chat) if top_logprobs is not None else None
        )
        choice = {"index": 0, "finish_reason": finish_reason(reason), "logprobs": logprobs}
        choice.update({"message": {"role": "assistant", "content": pieces.text}} if chat else {"text": pieces.text})
        return {
            "id": rid,
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": body.model,
            "choices": [choice],
            "usage": usage(len(prompt), pieces.tokens),
        }

    async def collect(sub: Submission, pieces: TextPieces):
        while True:
            event = await sub.events.get()
            if event[0] == "done":
                pieces.flush()
                return event[1], event[2]
            if pieces.add(event[1]):  # a stop string: the rest is not wanted
                loop_.cancel(sub.request.index)
                return "stop", None

    async def stream(sub: Submission, pieces: TextPieces, rid: str, chat: bool, model: str):
        created = int(time.time())

        want_logprobs = sub.request.top_logprobs is not None
        sent = 0  # tokens whose log-probabilities went out

        def chunk(delta: dict, reason=None, usage_=None):
            nonlocal sent
            logprobs = None
            if want_logprobs and delta.get("content"):
                logprobs = render_logprobs(tokenizer, sub.request.logprobs[sent : pieces.tokens], chat)
                sent = pieces.tokens
            choice = {"index": 0, "finish_reason": reason, "logprobs": logprobs}
            if chat:
                choice["delta"] = delta
            else:
                choice["text"] = delta.get("content", "")
            data = {
                "id": rid,
                "object": "chat.completion.chunk" if chat else "text_completion",
                "created": created,
                "model": model,
                "choices": [choice],
            }
            if usage_:
                data["usage"] = usage_
            return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"

        try:
            if chat:
                yield chunk({"role": "assistant", "content": ""})
            reason = None
            while reason is None:
                event = await sub.events.get()
                if event[0] == "done":
                    reason, tail = event[1], pieces.flush()
                    if tail:
                        yield chunk({"content": tail})
                    break
                before = len(pieces.text)
                stopped = pieces.add(event[1])
                if len(pieces.text) > before:
                    yield chunk({"content": pieces.text[before:]})
                if stopped:
                    loop_.cancel(sub.request.index)
                    reason = "stop"
            if reason in ("error", "shutdown"):
                message = "generation failed" if reason == "error" else "the server shut down before this finished"
                yield f"data: {json.dumps({'error': {'message': message, 'type': 'server_error'}})}\n\n"
            else:
                yield chunk({}, finish_reason(reason), usage(len(sub.request.prompt), pieces.tokens))
            yield "data: [DONE]\n\n"
        finally:  # the client went away (or we are done): its row leaves the batch
            if not sub.request.finished:
                loop_.cancel(sub.request.index)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatBody):
        messages = [{"role": m.role, "content": m.content} for m in body.messages]
        if body.top_logprobs is not None and not body.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        try:
            prompt = engine.target.encode_chat(messages)
        except DSparkError as e:
            raise ApiError(400, str(e), param="messages") from e
        return await run(body, prompt, chat=True, top_logprobs=(body.top_logprobs or 0) if body.logprobs else None)

    @app.post("/v1/completions")
    async def completions(body: CompletionBody):
        try:
            prompt = engine.target.encode_text(body.prompt)
        except DSparkError as e:
            raise ApiError(400, str(e), param="prompt") from e
        return await run(body, prompt, chat=False, top_logprobs=body.logprobs)

    return app


class TextPieces:
    """The text of a growing token list, released only in whole characters and cut at the first stop string."""

    def __init__(self, tokenizer, stops: list[str]):
        self.tokenizer, self.stops = tokenizer, [s for s in stops if s]
        self.ids: list[int] = []
        self.text = ""
        self.tokens = 0

    def add(self, tokens: list[int]) -> bool:
        """Take new tokens; True when a stop string was reached (the text then ends before it)."""
        self.ids += tokens
        self.tokens += len(tokens)
        full = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        cuts = [full.find(s) for s in self.stops if s in full]
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


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
