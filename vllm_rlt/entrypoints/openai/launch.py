"""`vllm-rlt serve`'s run: one API server in this process, or `--api-server-count` of them
in processes of their own (`api_servers.py`), until SIGTERM or SIGINT."""

from __future__ import annotations

import logging
import os
import sys
import threading

from vllm_rlt.engine.process_setup import freeze_startup_heap
from vllm_rlt.entrypoints.openai.api_servers import serve_with_api_servers
from vllm_rlt.entrypoints.openai.server import build_server, listen, log_like_uvicorn
from vllm_rlt.entrypoints.openai.server_state import ServerState
from vllm_rlt.entrypoints.openai.settings import ServerSettings

logger = logging.getLogger("vllm_rlt.server")


def serve(
    settings: ServerSettings, host: str, port: int, shutdown_timeout: float
) -> BaseException | None:
    """Run until SIGTERM/SIGINT: stop accepting, let requests finish within the timeout,
    abort the rest, exit. Returns the load error when the model failed to load and
    `exit_on_load_error` ended the server; raises OSError when the port cannot be bound."""
    if settings.api_server_count > 1:
        return serve_with_api_servers(settings, host, port, shutdown_timeout)
    sock = listen(host, port)
    log_like_uvicorn()
    state = ServerState(settings)
    server = build_server(state, host, port, shutdown_timeout)
    if settings.exit_on_load_error:

        def stop() -> None:
            server.should_exit = True

        state.on_load_error = stop
    loader = threading.Thread(target=_load, args=(state,), name="vllm-rlt-load", daemon=True)
    loader.start()
    try:
        server.run(sockets=[sock])
    finally:
        if state.engine is not None:
            state.engine.shutdown()
    if loader.is_alive():
        # Stopped during a load: the loading thread cannot be interrupted, and ending the
        # interpreter under it would abort the process, so leave without finalising.
        logger.info("stopped while the model was still loading")
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return state.load_error if settings.exit_on_load_error else None


def _load(state: ServerState) -> None:
    """Load the model while the server already answers /health; then settle the process
    (`process_setup`)."""
    state.load()
    if state.load_error is None:
        freeze_startup_heap()
