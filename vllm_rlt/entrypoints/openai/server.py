"""The OpenAI-compatible HTTP server (FastAPI + uvicorn) around an AsyncLLM."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

import vllm_rlt
from vllm_rlt.engine.async_llm import AsyncLLM
from vllm_rlt.engine.llm import LLM
from vllm_rlt.entrypoints.openai.metrics import ServerMetrics
from vllm_rlt.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from vllm_rlt.entrypoints.openai.serving import APIError, OpenAIServing


@dataclass
class ServerSettings:
    """Server-only options (engine options travel as LLM keyword arguments)."""

    served_model_name: str | None = None
    api_key: str | None = None
    max_queue: int | None = None
    request_timeout: float | None = None
    max_body_bytes: int = 1 << 20
    stall_timeout: float = 60.0
    llm_kwargs: dict[str, Any] = field(default_factory=dict)


class ServerState:
    """What the routes need; filled in once the model has loaded (in the background)."""

    def __init__(self, settings: ServerSettings) -> None:
        self.settings = settings
        self.engine: AsyncLLM | None = None
        self.serving: OpenAIServing | None = None
        self.metrics: ServerMetrics | None = None
        self.load_error: BaseException | None = None

    def load(self) -> None:
        try:
            llm = LLM(**self.settings.llm_kwargs)
            metrics = ServerMetrics(llm.engine.num_loops)
            engine = AsyncLLM(
                llm.engine, self.settings.max_queue, metrics.on_step, tokenizer=llm.tokenizer
            )
            name = self.settings.served_model_name or llm.model_name
            self.serving = OpenAIServing(engine, llm.tokenizer, name, self.settings.request_timeout)
            self.metrics, self.engine = metrics, engine
        except BaseException as exc:  # reported by /health and every route
            self.load_error = exc

    def ready(self) -> OpenAIServing:
        if self.load_error is not None:
            raise APIError(503, f"model failed to load: {self.load_error}", "service_unavailable")
        if self.serving is None:
            raise APIError(503, "the model is still loading", "service_unavailable")
        return self.serving


def error_response(error: APIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status)


class _BodyTooLarge(Exception):
    pass


class GuardMiddleware:
    """API key on every route but /health, and the body size limit (declared or streamed).
    Plain ASGI, so that handlers still see a client's disconnect."""

    def __init__(self, app, api_key: str | None, max_body: int) -> None:
        self.app, self.api_key, self.max_body = app, api_key, max_body

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {key.decode().lower(): value.decode() for key, value in scope["headers"]}
        if self.api_key is not None and scope["path"] != "/health":
            if headers.get("authorization") != f"Bearer {self.api_key}":
                error = APIError(401, "missing or wrong API key", "authentication_error")
                await error_response(error)(scope, receive, send)
                return
        too_large = APIError(413, f"request body over {self.max_body} bytes", "too_large")
        length = headers.get("content-length", "")
        if length.isdigit() and int(length) > self.max_body:
            await error_response(too_large)(scope, receive, send)
            return
        seen = 0
        started = False

        async def counted_receive():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_body:
                    raise _BodyTooLarge
            return message

        async def tracked_send(message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted_receive, tracked_send)
        except _BodyTooLarge:
            if not started:
                await error_response(too_large)(scope, receive, send)


def build_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="vllm-rlt", version=vllm_rlt.__version__)
    app.state.server = state
    settings = state.settings
    app.add_middleware(GuardMiddleware, api_key=settings.api_key, max_body=settings.max_body_bytes)

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        location = [str(p) for p in first.get("loc", ()) if p != "body"]
        param = ".".join(location) or None
        kind = first.get("type", "")
        if kind == "extra_forbidden":
            message = f"unsupported field: {param}"
        elif kind == "json_invalid":
            message = f"request body is not valid JSON: {first.get('msg', '')}"
            param = None
        else:
            message = (
                f"{param}: {first.get('msg', 'invalid value')}"
                if param
                else first.get("msg", "invalid request")
            )
        return error_response(APIError(400, message, param=param))

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        return error_response(APIError(500, f"internal error: {exc!r}", "internal_error"))

    @app.get("/health")
    async def health() -> JSONResponse:
        if state.load_error is not None or state.engine is None:
            status = "failed" if state.load_error is not None else "loading"
            return JSONResponse({"status": status}, status_code=503)
        engine = state.engine
        if engine.dead is not None:
            return JSONResponse({"status": "engine stopped"}, status_code=503)
        stalled = time.monotonic() - engine.last_progress > settings.stall_timeout
        if engine.has_work and stalled:
            return JSONResponse({"status": "stalled"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": vllm_rlt.__version__}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        serving = state.ready()
        return {
            "object": "list",
            "data": [
                {
                    "id": serving.model_name,
                    "object": "model",
                    "created": 0,
                    "owned_by": "vllm-rlt",
                    "max_model_len": serving.max_model_len,
                }
            ],
        }

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        state.ready()
        assert state.metrics is not None
        return PlainTextResponse(
            generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST
        )

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        serving = state.ready()
        if body.messages is not None:
            _, tokens = serving.chat_prompt(body.model, body.messages)
        else:
            tokenizer = serving.tokenizer_for(body.model)
            tokens = tokenizer.encode(body.prompt or "", body.add_special_tokens)
        return {"tokens": tokens, "count": len(tokens), "max_model_len": serving.max_model_len}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        tokenizer = state.ready().tokenizer_for(body.model)
        vocab = tokenizer.vocab_size
        for token in body.tokens:
            if not 0 <= token < vocab:
                raise APIError(400, f"tokens entries must be in [0, {vocab - 1}]", param="tokens")
        return {"prompt": tokenizer.decode(body.tokens)}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        serving = state.ready()
        job = await asyncio.to_thread(serving.completion_job, body)
        return await _respond(serving, job, body.stream, body.stream_options, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        serving = state.ready()
        job = await asyncio.to_thread(serving.chat_job, body)
        return await _respond(serving, job, body.stream, body.stream_options, request)

    return app


async def _respond(serving: OpenAIServing, job, stream: bool, options, request: Request):
    if stream:
        events = serving.stream(job, include_usage=bool(options and options.include_usage))
        first = await anext(events)  # errors found before streaming become plain 4xx replies
        if first.startswith('data: {"error"'):
            body = json.loads(first[len("data: ") :])
            return JSONResponse(body, status_code=body["error"]["code"])

        async def body_events():
            yield first
            async for event in events:
                yield event

        return StreamingResponse(body_events(), media_type="text/event-stream")
    work = asyncio.ensure_future(serving.run(job))
    while not work.done():  # a client that leaves gets its requests aborted at once
        done, _ = await asyncio.wait({work}, timeout=0.05)
        if not done and await request.is_disconnected():
            work.cancel()
            return JSONResponse({}, status_code=499)
    return JSONResponse(work.result())


class _Server(uvicorn.Server):
    """uvicorn re-raises SIGTERM after a graceful shutdown (the process then dies of the
    signal); a drained shutdown should instead exit with status 0."""

    @contextlib.contextmanager
    def capture_signals(self):
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in _EXIT_SIGNALS}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


_EXIT_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def serve(settings: ServerSettings, host: str, port: int, shutdown_timeout: float) -> None:
    """Run until SIGTERM/SIGINT: stop accepting, let requests finish within the timeout,
    abort the rest, exit."""
    state = ServerState(settings)
    threading.Thread(target=state.load, name="vllm-rlt-load", daemon=True).start()
    app = build_app(state)
    config = uvicorn.Config(
        app, host=host, port=port, log_level="info", timeout_graceful_shutdown=shutdown_timeout
    )
    server = _Server(config)
    try:
        server.run()
    finally:
        if state.engine is not None:
            state.engine.shutdown()
