"""The OpenAI-compatible HTTP server (FastAPI + uvicorn) around an AsyncLLM."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import importlib.util
import logging
import os
import signal
import socket
from collections.abc import Callable
from typing import Any

import orjson
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

import vllm_rlt
from vllm_rlt.engine.async_llm import AsyncLLM
from vllm_rlt.engine.process.core_client import CoreAttachment
from vllm_rlt.engine.trainer_hooks import WAKE_TAGS
from vllm_rlt.entrypoints.openai.connection import DrainingServer, limited_protocol
from vllm_rlt.entrypoints.openai.metrics import ServerMetrics
from vllm_rlt.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    describe_validation_error,
)
from vllm_rlt.entrypoints.openai.rl_routes import add_rl_routes
from vllm_rlt.entrypoints.openai.serving import (
    APIError,
    OpenAIServing,
)
from vllm_rlt.entrypoints.openai.settings import ServerSettings

logger = logging.getLogger("vllm_rlt.server")


def _cores(settings: ServerSettings) -> str:
    """The engine cores behind this server, in words."""
    if settings.disaggregate is not None:
        prefill, decode = settings.disaggregate
        return f"{prefill} prefill and {decode} decode engine cores"
    if settings.data_parallel_size > 1:
        return f"{settings.data_parallel_size} data-parallel engine cores"
    return "the engine core"


class ServerState:
    """What the routes need; filled in once the model has loaded (in the background)."""

    def __init__(
        self, settings: ServerSettings, attach: list[CoreAttachment] | None = None
    ) -> None:
        self.settings = settings
        # Join the cores another process started, one per data-parallel rank (this is one
        # of several API servers).
        self.attach = attach
        self.engine: AsyncLLM | None = None
        self.serving: OpenAIServing | None = None
        self.metrics: ServerMetrics | None = None
        self.load_error: BaseException | None = None
        self.on_load_error: Callable[[], None] | None = None

    def load(self) -> None:
        try:
            engine = AsyncLLM(
                self.settings.llm_kwargs,
                self.settings.max_queue,
                in_process=self.settings.engine_in_process,
                attach=self.attach,
                data_parallel_size=self.settings.data_parallel_size,
                remote_cores=self.settings.remote_cores,
                generation_config=self.settings.generation_config,
                generation_config_ignore_invalid=self.settings.generation_config_ignore_invalid,
                disaggregate=self.settings.disaggregate,
                kv_connector=self.settings.kv_connector,
            )
            name = self.settings.served_model_name or engine.model_name
            index = self.attach[0].client if self.attach is not None else 1
            metrics = ServerMetrics(engine.info.num_loops, name, index)
            engine.observer = metrics
            self.serving = OpenAIServing(
                engine,
                engine.tokenizer,
                name,
                self.settings.request_timeout,
                self.settings.max_sequences_per_request,
            )
            self.metrics, self.engine = metrics, engine
            if self.attach is not None:
                logger.info(
                    "API server %d of %d ready (pid %d)",
                    self.attach[0].client,
                    self.settings.api_server_count,
                    os.getpid(),
                )
                return
            processes = getattr(engine.client, "processes", None) or [engine.client.process]
            pids = ", ".join(str(p.pid) for p in processes if p is not None)
            logger.info(
                "model %s loaded (%s, %d KV blocks) in %s%s%s; ready",
                name,
                engine.info.device,
                engine.info.num_blocks,
                _cores(self.settings),
                f" (pid {pids})" if pids else "",
                f", K/V through {engine.client.kv_connector}"
                if self.settings.disaggregate is not None
                else "",
            )
            logger.info("%s", engine.info.scheduler_note)
        except BaseException as exc:  # reported by /health and every route
            self.load_error = exc
            user_error = isinstance(exc, (ValueError, OSError))  # the message says it all
            if self.on_load_error is None or not user_error:
                logger.error(
                    "the model failed to load: %s",
                    exc,
                    exc_info=None if user_error else exc,
                )
            if self.on_load_error is not None:
                self.on_load_error()

    def ready(self) -> OpenAIServing:
        if self.load_error is not None:
            raise APIError(503, f"model failed to load: {self.load_error}", "service_unavailable")
        if self.serving is None:
            raise APIError(503, "the model is still loading", "service_unavailable")
        return self.serving

    def loaded_engine(self) -> AsyncLLM:
        """The engine once loaded (APIError 503 before)."""
        self.ready()
        assert self.engine is not None
        return self.engine

    def abort_all(self) -> int:
        """End every request now (shutdown); how many there were."""
        if self.serving is None or self.engine is None:
            return 0
        self.serving.closing = True
        running = self.engine.num_requests
        self.engine.abort_all()
        return running


class FastJSONResponse(JSONResponse):
    """JSON rendered by orjson: several times faster than the standard library."""

    def render(self, content: Any) -> bytes:
        return orjson.dumps(content)


def error_response(error: APIError, headers: dict[str, str] | None = None) -> JSONResponse:
    return FastJSONResponse(error.body(), status_code=error.status, headers=headers)


class _BodyTooLarge(Exception):
    pass


class _ClientGone(Exception):
    pass


class GuardMiddleware:
    """Before any route runs: the API key on every route but /health (compared in constant
    time), and the whole body read within the size and time limits. Every POST body is
    JSON, whatever Content-Type the client sent (`curl -d` sends a form type). Plain ASGI,
    so that handlers still see a client's disconnect."""

    def __init__(self, app, api_key: str | None, max_body: int, body_timeout: float) -> None:
        self.app, self.max_body, self.body_timeout = app, max_body, body_timeout
        self.expected = None if api_key is None else b"Bearer " + api_key.encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])  # raw bytes: a header need not be UTF-8
        body = await self._body_or_refusal(scope["path"], headers, receive)
        if body is None:
            return  # the client left while sending
        if isinstance(body, JSONResponse):
            await body(scope, receive, send)
            return
        if scope["method"] == "POST" and b"json" not in headers.get(b"content-type", b""):
            kept = [(k, v) for k, v in scope["headers"] if k != b"content-type"]
            scope = {**scope, "headers": [*kept, (b"content-type", b"application/json")]}
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _body_or_refusal(self, path: str, headers, receive) -> bytes | JSONResponse | None:
        """The whole body, or the error reply that refuses the request."""
        if self.expected is not None and path != "/health":
            if not hmac.compare_digest(headers.get(b"authorization", b""), self.expected):
                return error_response(
                    APIError(401, "missing or wrong API key", "authentication_error")
                )
        close = {"connection": "close"}
        too_large = APIError(413, f"request body over {self.max_body} bytes", "too_large")
        length = headers.get(b"content-length", b"0")
        if length.isdigit() and int(length) > self.max_body:
            return error_response(too_large, close)
        try:
            body = await asyncio.wait_for(self._read_body(receive), self.body_timeout)
        except _BodyTooLarge:
            return error_response(too_large, close)
        except asyncio.TimeoutError:
            message = f"request body not received within {self.body_timeout:g} s"
            return error_response(APIError(408, message, "timeout_error"), close)
        except _ClientGone:
            return None
        try:
            body.decode("utf-8")
        except UnicodeDecodeError as exc:
            message = f"request body is not UTF-8 text (byte {exc.start})"
            return error_response(APIError(400, message))
        return body

    async def _read_body(self, receive) -> bytes:
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise _ClientGone
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body:
                raise _BodyTooLarge
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)


BODY_MODELS = {
    "/v1/completions": CompletionRequest,
    "/v1/chat/completions": ChatCompletionRequest,
    "/tokenize": TokenizeRequest,
    "/detokenize": DetokenizeRequest,
}


def build_app(state: ServerState) -> FastAPI:
    app = FastAPI(
        title="vllm-rlt", version=vllm_rlt.__version__, default_response_class=FastJSONResponse
    )
    app.state.server = state
    settings = state.settings
    app.add_middleware(
        GuardMiddleware,
        api_key=settings.api_key,
        max_body=settings.max_body_bytes,
        body_timeout=settings.body_timeout,
    )

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        model = BODY_MODELS.get(request.url.path)
        message, param = describe_validation_error(list(exc.errors()), model)
        return error_response(APIError(400, message, param=param))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        status, method, path = exc.status_code, request.method, request.url.path
        if status == 404:
            error = APIError(404, f"no route {method} {path}", "not_found_error")
        elif status == 405:
            error = APIError(405, f"{path} does not accept {method}", "method_not_allowed")
        elif status == 400:  # the body could not be decoded at all (for example too deep)
            error = APIError(400, "request body is not valid JSON (or is nested too deeply)")
        else:
            error = APIError(status, str(exc.detail), "invalid_request_error")
        return error_response(error, exc.headers)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        logger.error("unexpected error in a request handler", exc_info=exc)
        return error_response(APIError(500, f"internal error: {exc!r}", "internal_error"))

    @app.get("/health")
    async def health() -> JSONResponse:
        if state.load_error is not None or state.engine is None:
            status = "failed" if state.load_error is not None else "loading"
            return JSONResponse({"status": status}, status_code=503)
        engine = state.engine
        if engine.dead is not None:
            return JSONResponse(
                {"status": "engine stopped", "reason": str(engine.dead)}, status_code=503
            )
        lost = engine.lost_cores()
        if lost is not None:  # the others still serve, but the server needs a restart
            return JSONResponse({"status": "degraded", "reason": lost}, status_code=503)
        stalled = engine.stalled(settings.stall_timeout)
        if stalled is not None:
            return JSONResponse({"status": "stalled", "reason": stalled}, status_code=503)
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
        assert state.metrics is not None and state.engine is not None
        try:
            engine = await asyncio.to_thread(state.engine.engine_stats, METRICS_CALL_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - the request figures still go out
            logger.warning("/metrics without the engine's counters: %s", exc)
            engine = None
        text = await asyncio.to_thread(state.metrics.render, engine)
        return PlainTextResponse(text, media_type=CONTENT_TYPE_LATEST)

    if settings.enable_sleep_mode:
        _add_sleep_routes(app, state)
    if settings.enable_weight_updates:
        add_rl_routes(app, state.loaded_engine)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        serving = state.ready()
        if body.messages is not None:
            _, tokens = serving.chat_prompt(body.model, body.messages)
        else:
            tokenizer = serving.tokenizer_for(body.model)
            tokens = tokenizer.encode(body.prompt or "", body.add_special_tokens)
        return {"tokens": tokens, "count": len(tokens), "max_model_len": serving.max_model_len}

    @app.get("/tokenizer_info")
    async def tokenizer_info() -> dict[str, Any]:
        """What a client needs to tokenize as the server does (lm-eval's remote tokenizer
        reads it, with /tokenize and /detokenize)."""
        serving = state.ready()
        tokenizer = serving.tokenizer_for(None)
        return {
            "tokenizer_class": "vllm-rlt",
            "eos_token": tokenizer.eos_token,
            "bos_token": tokenizer.bos_token,
            "pad_token": None,
            "chat_template": tokenizer.chat_template,
            "vocab_size": tokenizer.vocab_size,
            "model_max_length": serving.max_model_len,
        }

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
        job = await _build(serving.completion_job, body, request)
        return await _respond(serving, job, body.stream, body.stream_options, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        serving = state.ready()
        job = await _build(serving.chat_job, body, request)
        return await _respond(serving, job, body.stream, body.stream_options, request)

    return app


INLINE_BODY_BYTES = 16 * 1024
METRICS_CALL_TIMEOUT_S = 5.0


def _add_sleep_routes(app: FastAPI, state: ServerState) -> None:
    """vLLM's sleep-mode endpoints (`--enable-sleep-mode`), answered by the engine core
    between passes; the API key guards them as it guards every route."""

    async def call(name: str) -> dict[str, Any]:
        state.ready()
        assert state.engine is not None
        answer = await asyncio.to_thread(state.engine.memory_call, name)
        if "error" in answer:
            raise APIError(409, str(answer["error"]), "conflict_error")
        return answer

    @app.post("/sleep")
    async def sleep(level: int = 1) -> dict[str, Any]:
        if level != 1:
            raise APIError(
                400,
                f"level must be 1 (level 2 drops the weights, which the server cannot load "
                f"again), got {level}",
                param="level",
            )
        return await call(f"sleep_{level}")

    @app.post("/wake_up")
    async def wake_up(request: Request) -> dict[str, Any]:
        tags = request.query_params.getlist("tags")  # vLLM's ?tags=weights&tags=kv_cache
        for tag in tags:
            if tag not in WAKE_TAGS:
                raise APIError(
                    400, f"tags must be among {list(WAKE_TAGS)}, got {tag!r}", param="tags"
                )
        return await call("wake_up:" + ",".join(tags) if tags else "wake_up")

    @app.get("/is_sleeping")
    async def is_sleeping() -> dict[str, Any]:
        return await call("is_sleeping")

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> dict[str, Any]:
        answer = await call("reset_prefix_cache")
        if not answer["reset"]:
            raise APIError(409, "requests hold KV blocks: reset when idle", "conflict_error")
        return answer


async def _build(make_job, body, request: Request):
    """Tokenize and validate: on the event loop for a small body (a thread hop costs more
    than the work), on a worker thread for a large one (so it cannot stall other clients)."""
    if len(await request.body()) <= INLINE_BODY_BYTES:
        return make_job(body)
    return await asyncio.to_thread(make_job, body)


async def _respond(serving: OpenAIServing, job, stream: bool, options, request: Request):
    """Run a job while watching the client: one that leaves, even while its requests still
    wait for a slot, gets them aborted at once."""
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        if not stream:
            work = asyncio.ensure_future(serving.run(job))
            if not await _first_of(work, gone):
                return Response(status_code=499)
            return FastJSONResponse(work.result())
        events = serving.stream(job, include_usage=bool(options and options.include_usage))
        first = asyncio.ensure_future(anext(events))
        if not await _first_of(first, gone):
            await events.aclose()
            return Response(status_code=499)
        head = first.result()
        if head.startswith(b'data: {"error"'):  # failed before streaming: a plain error reply
            await events.aclose()
            body = orjson.loads(head[len(b"data: ") :])
            return FastJSONResponse(body, status_code=body["error"]["code"])

        async def body_events():
            try:
                yield head
                async for event in events:
                    yield event
            finally:
                await events.aclose()

        return StreamingResponse(body_events(), media_type="text/event-stream")
    finally:
        gone.cancel()


async def _first_of(work: asyncio.Future, gone: asyncio.Future) -> bool:
    """Wait for `work` or the client's disconnect; False (and `work` cancelled) if the
    client left first."""
    await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    if work.done():
        return True
    work.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await work
    return False


async def _disconnected(request: Request) -> None:
    """Returns once the client has closed its connection."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def build_server(
    state: ServerState,
    host: str,
    port: int,
    drain_timeout: float,
    log_level: str = "info",
    stop_signals: tuple[signal.Signals, ...] = (signal.SIGINT, signal.SIGTERM),
    announce: bool = True,
) -> DrainingServer:
    settings = state.settings
    config = uvicorn.Config(
        build_app(state),
        host=host,
        port=port,
        log_level=log_level,
        http=limited_protocol(
            settings.header_timeout, settings.max_connections, settings.max_header_bytes
        ),
        loop="uvloop" if importlib.util.find_spec("uvloop") else "asyncio",
        access_log=settings.access_log,
        timeout_keep_alive=settings.keep_alive_timeout,
        h11_max_incomplete_event_size=settings.max_header_bytes,
        # Our own drain aborts what is left at drain_timeout; the margin lets those
        # requests send their final chunks before uvicorn would cancel them.
        timeout_graceful_shutdown=drain_timeout + 10,
    )
    return DrainingServer(config, drain_timeout, state.abort_all, stop_signals, announce)


def listen(host: str, port: int) -> socket.socket:
    """Bind the listening socket first, so that a taken port is an error before anything
    else starts (OSError)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def log_like_uvicorn() -> None:
    """The engine's and the server's own log lines, in uvicorn's format beside its own."""
    from uvicorn.logging import DefaultFormatter

    package = logging.getLogger("vllm_rlt")
    if any(getattr(handler, "like_uvicorn", False) for handler in package.handlers):
        return
    handler = logging.StreamHandler()
    handler.setFormatter(DefaultFormatter("%(levelprefix)s %(message)s"))
    handler.like_uvicorn = True  # type: ignore[attr-defined]
    package.addHandler(handler)
    package.setLevel(logging.INFO)
    package.propagate = False
