"""The OpenAI-compatible HTTP server (FastAPI + uvicorn) around an AsyncLLM: the app with
its routes, and the uvicorn server that runs it."""

from __future__ import annotations

import asyncio
import importlib.util
import logging
import signal
import socket
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

import vllm_rlt
from vllm_rlt.config import ParamError
from vllm_rlt.entrypoints.openai.api_errors import (
    APIError,
    FastJSONResponse,
    as_api_error,
    error_response,
)
from vllm_rlt.entrypoints.openai.connection import DrainingServer, limited_protocol
from vllm_rlt.entrypoints.openai.job_replies import build_job, respond
from vllm_rlt.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    check_token_ids,
)
from vllm_rlt.entrypoints.openai.request_errors import ServedLimits, describe_validation_error
from vllm_rlt.entrypoints.openai.request_guard import GuardMiddleware
from vllm_rlt.entrypoints.openai.rl_routes import add_rl_routes
from vllm_rlt.entrypoints.openai.server_state import ServerState
from vllm_rlt.entrypoints.openai.sleep_routes import add_sleep_routes

logger = logging.getLogger("vllm_rlt.server")


BODY_MODELS = {
    "/v1/completions": CompletionRequest,
    "/v1/chat/completions": ChatCompletionRequest,
    "/tokenize": TokenizeRequest,
    "/detokenize": DetokenizeRequest,
}


def build_app(state: ServerState) -> FastAPI:
    app = FastAPI(
        title="vllm-rlt",
        version=vllm_rlt.__version__,
        default_response_class=FastJSONResponse,
        redirect_slashes=False,  # /v1/completions/ is a JSON 404, not a bare 307
    )
    app.state.server = state
    settings = state.settings
    app.add_middleware(
        GuardMiddleware,
        api_key=settings.api_key,
        max_body=settings.max_body_bytes,
        body_timeout=settings.body_timeout,
        allowed_origins=settings.allowed_origins,
    )
    if settings.allowed_origins:  # outside the guard: a preflight carries no API key
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(settings.allowed_origins),
            allow_methods=list(settings.allowed_methods),
            allow_headers=list(settings.allowed_headers),
            allow_credentials=settings.allow_credentials,
        )

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        path = request.url.path
        model, served = BODY_MODELS.get(path), served_limits(state, path)
        message, param = describe_validation_error(list(exc.errors()), model, served)
        return error_response(APIError(400, message, param=param))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        status, method, path = exc.status_code, request.method, request.url.path
        if status == 404:
            error = APIError(404, f"no route {method} {path}", "not_found_error")
        elif status == 405:
            error = APIError(405, f"{path} does not accept {method}", "method_not_allowed")
        elif status == 400:  # the body could not be decoded at all (for example too deep)
            error = APIError(
                400,
                "request body is not valid JSON (or is nested too deeply, or holds an integer "
                "of more than 4300 digits)",
            )
        else:
            error = APIError(status, str(exc.detail), "invalid_request_error")
        return error_response(error, exc.headers)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        logger.error("unexpected error in a request handler", exc_info=exc)
        return error_response(APIError(500, f"internal error: {exc!r}", "internal_error"))

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

    # /ping is vLLM's name for load balancers. A route per method, so that each operation in
    # the OpenAPI schema has an id of its own.
    for path, methods in (("/health", ("GET", "HEAD")), ("/ping", ("GET", "HEAD", "POST"))):
        for method in methods:
            app.add_api_route(
                path, health, methods=[method], operation_id=f"{path[1:]}_{method.lower()}"
            )

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
                    "id": serving.jobs.model_name,
                    "object": "model",
                    "created": 0,
                    "owned_by": "vllm-rlt",
                    "max_model_len": serving.jobs.max_model_len,
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
        add_sleep_routes(app, state)
    if settings.enable_weight_updates:
        add_rl_routes(app, state.loaded_engine)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest, request: Request) -> dict[str, Any]:
        serving = state.ready()
        tokens = await build_job(serving.jobs.tokenize, body, request)
        return {"tokens": tokens, "count": len(tokens), "max_model_len": serving.jobs.max_model_len}

    @app.get("/tokenizer_info")
    async def tokenizer_info() -> dict[str, Any]:
        """What a client needs to tokenize as the server does (lm-eval's remote tokenizer
        reads it, with /tokenize and /detokenize)."""
        serving = state.ready()
        tokenizer = serving.jobs.tokenizer_for(None)
        return {
            "tokenizer_class": "vllm-rlt",
            "eos_token": tokenizer.eos_token,
            "bos_token": tokenizer.bos_token,
            "pad_token": None,
            "chat_template": tokenizer.chat_template,
            "vocab_size": tokenizer.vocab_size,
            "model_max_length": serving.jobs.max_model_len,
        }

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        tokenizer = state.ready().jobs.tokenizer_for(body.model)
        try:
            check_token_ids("tokens", body.tokens, tokenizer.vocab_size)
        except ParamError as exc:
            raise as_api_error(exc) from exc
        # special tokens kept, as vLLM decodes them here
        return {"prompt": tokenizer.decode(body.tokens, skip_special_tokens=False)}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        serving = state.ready()
        job = await build_job(serving.jobs.completion_job, body, request)
        return await respond(serving, job, bool(body.stream), body.stream_options, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        serving = state.ready()
        job = await build_job(serving.jobs.chat_job, body, request)
        return await respond(serving, job, bool(body.stream), body.stream_options, request)

    return app


METRICS_CALL_TIMEOUT_S = 5.0


def served_limits(state: ServerState, path: str) -> ServedLimits:
    """The loaded model's bounds for a body sent to `path` (none while it loads): the
    engine's, and for /detokenize, which decodes, the tokenizer's vocabulary."""
    serving = state.serving
    if serving is None:
        return ServedLimits()
    info = serving.engine.info
    vocab = info.vocab_size
    if path == "/detokenize" and serving.jobs.tokenizer is not None:
        vocab = serving.jobs.tokenizer.vocab_size
    return ServedLimits(info.num_loops, info.max_model_len, vocab)


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
