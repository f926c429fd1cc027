"""`dspark serve`: an OpenAI-compatible HTTP API over the engine loop.

/v1/chat/completions and /v1/completions (streamed as server-sent events, `data: [DONE]` last, or whole),
/v1/models, /health, /metrics. Errors are OpenAI-style JSON ({"error": {"message", "type", "param", "code"}}) with
the status a client expects: 400 bad request, 401 wrong or missing API key, 404 unknown model, 411 a body without
Content-Length, 413 body too large, 429 too many requests in flight, 503 shutting down. Nothing here knows how decoding works: it validates, encodes,
submits to the loop and turns tokens into text.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass
from itertools import count

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, Field

from dspark.decoding.requests import RequestState
from dspark.errors import DSparkError
from dspark.sampling import SamplingParams
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
    drain_seconds: float = 10.0  # graceful shutdown: in-flight requests get this long to finish


class ChatMessage(BaseModel):
    role: str
    content: str


class GenerationBody(BaseModel):
    model: str
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float = Field(1.0, ge=0.0, le=100.0, allow_inf_nan=False)
    top_p: float = Field(1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int = Field(0, ge=0)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    n: int = Field(1, ge=1, le=1)


class ChatBody(GenerationBody):
    messages: list[ChatMessage] = Field(min_length=1)


class CompletionBody(GenerationBody):
    prompt: str


class ApiError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", code: str | None = None,
                 param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.code, self.param = status, message, kind, code, param

    def response(self) -> JSONResponse:
        return JSONResponse({"error": {"message": self.message, "type": self.kind, "param": self.param,
                                       "code": self.code}}, status_code=self.status)


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
        state["accepting"] = False
        await asyncio.to_thread(loop_.stop, config.drain_seconds)

    app = FastAPI(title="dspark", lifespan=lifespan)
    app.state.engine_loop, app.state.metrics = loop_, metrics

    @app.exception_handler(ApiError)
    async def api_error(_request, e: ApiError):
        return e.response()

    @app.exception_handler(RequestValidationError)
    async def invalid(_request, e: RequestValidationError):
        first = e.errors()[0] if e.errors() else {}
        where = ".".join(str(x) for x in first.get("loc", ())[1:]) or None
        message = first.get("msg", "invalid request")
        if first.get("type") == "json_invalid":
            message = "the request body is not valid JSON"
        return ApiError(400, f"{message}{f' ({where})' if where else ''}", param=where).response()

    @app.middleware("http")
    async def guard(request: Request, call_next):
        if request.url.path.startswith("/v1/"):
            if config.api_key and request.headers.get("authorization") != f"Bearer {config.api_key}":
                return ApiError(401, "invalid or missing API key (send 'Authorization: Bearer KEY')",
                                "authentication_error", "invalid_api_key").response()
            size = request.headers.get("content-length")
            if request.method == "POST" and size is None:  # a body of unknown length could be any size
                return ApiError(411, "send the request body with a Content-Length header",
                                code="length_required").response()
            if size is not None and size.isdigit() and int(size) > config.max_body_bytes:
                return ApiError(413, f"request body of {size} bytes is over the limit of {config.max_body_bytes}",
                                code="request_too_large").response()
        return await call_next(request)

    @app.get("/health")
    async def health():
        return {"status": "ok" if state["accepting"] else "shutting down", "active": loop_.load()}

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.text(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": config.model_name, "object": "model", "created": 0,
                                            "owned_by": "dspark"}]}

    def prepare(body: GenerationBody, prompt: list[int]) -> tuple[RequestState, SamplingParams, list[str]]:
        if body.model != config.model_name:
            raise ApiError(404, f"model '{body.model}' is not served here; this server serves '{config.model_name}'",
                           code="model_not_found", param="model")
        if not state["accepting"]:
            raise ApiError(503, "the server is shutting down", "server_error")
        wanted = body.max_completion_tokens or body.max_tokens
        if wanted is not None and not 1 <= wanted <= config.max_tokens_limit:
            raise ApiError(400, f"max_tokens must be between 1 and {config.max_tokens_limit}, got {wanted}",
                           param="max_tokens")
        if len(prompt) >= (window or 1 << 62):
            raise ApiError(400, f"the prompt has {len(prompt)} tokens; this model's context window is {window}",
                           code="context_length_exceeded", param="messages")
        if loop_.load() >= config.max_concurrent:
            raise ApiError(429, f"{config.max_concurrent} requests are in flight; retry later", "rate_limit_error")
        stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        try:
            request = RequestState(next(ids), prompt, wanted or config.default_max_tokens, stop_ids, window)
            sampling = SamplingParams(body.temperature, body.top_k, body.top_p, body.seed)
        except DSparkError as e:
            raise ApiError(400, str(e)) from e
        return request, sampling, stops

    async def run(body: GenerationBody, prompt: list[int], chat: bool):
        request, sampling, stops = prepare(body, prompt)
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
        message = {"role": "assistant", "content": pieces.text}
        choice = {"index": 0, "finish_reason": finish_reason(reason)}
        choice.update({"message": message, "logprobs": None} if chat else {"text": pieces.text, "logprobs": None})
        return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
                "model": body.model, "choices": [choice], "usage": usage(len(prompt), pieces.tokens)}

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

        def chunk(delta: dict, reason=None, usage_=None):
            choice = {"index": 0, "finish_reason": reason}
            if chat:
                choice["delta"] = delta
            else:
                choice.update(text=delta.get("content", ""), logprobs=None)
            data = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
                    "model": model, "choices": [choice]}
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
            if reason == "error":
                yield f"data: {json.dumps({'error': {'message': 'generation failed', 'type': 'server_error'}})}\n\n"
            else:
                yield chunk({}, finish_reason(reason), usage(len(sub.request.prompt), pieces.tokens))
            yield "data: [DONE]\n\n"
        finally:  # the client went away (or we are done): its row leaves the batch
            if not sub.request.finished:
                loop_.cancel(sub.request.index)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatBody):
        messages = [m.model_dump() for m in body.messages]
        if any(m["role"] not in ("system", "user", "assistant") for m in messages):
            raise ApiError(400, "message roles are system, user and assistant", param="messages")
        try:
            prompt = engine.target.encode_chat(messages)
        except DSparkError as e:
            raise ApiError(400, str(e), param="messages") from e
        return await run(body, prompt, chat=True)

    @app.post("/v1/completions")
    async def completions(body: CompletionBody):
        if not body.prompt:
            raise ApiError(400, "the prompt is empty", param="prompt")
        return await run(body, tokenizer.encode(body.prompt), chat=False)

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
        """At the end of generation: release what was held back. Returns the newly released text."""
        before = len(self.text)
        self.text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        return self.text[before:]


def finish_reason(reason: str) -> str:
    return {"stop": "stop", "length": "length", "cancelled": "stop"}.get(reason, reason)


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}
