"""`--api-server-count N`: N API-server processes in front of the engine core (or of each
of the `--data-parallel-size` cores).

One frontend process tops out at what one interpreter can do for HTTP, JSON, tokenizing
and detokenizing. Here the main process loads the model in the engine core, binds the
port, and starts N API servers that share the listening socket (the kernel hands each
new connection to one of them). Each server is a client of every core with its own
sockets; a core sends every request's outputs back to the server that sent it. With
several cores, each server places its own requests on the least loaded core. Request
metrics are written to prometheus' multiprocess files, so any server's /metrics sums all.

The main process supervises: SIGTERM or SIGINT drain every server (each ends its own
requests within the shutdown timeout), then the core stops and the process exits 0. A
server that dies ends the whole server with exit code 1; a core that dies turns every
server's /health to 503 and fails the requests it held, as with one server.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import socket
import tempfile
import threading

from vllm_rlt.engine.parent_watch import leave_with_parent
from vllm_rlt.engine.process.clients import make_client
from vllm_rlt.engine.process.core_client import CoreAttachment
from vllm_rlt.engine.process_setup import freeze_startup_heap
from vllm_rlt.entrypoints.openai.server import build_server, listen, log_like_uvicorn
from vllm_rlt.entrypoints.openai.server_state import ServerState
from vllm_rlt.entrypoints.openai.settings import ServerSettings

logger = logging.getLogger("vllm_rlt.server")

SUPERVISE_TICK_S = 0.5


class APIServerFailed(RuntimeError):
    """An API-server process died; the whole server was stopped."""


def serve_with_api_servers(
    settings: ServerSettings, host: str, port: int, shutdown_timeout: float
) -> BaseException | None:
    """Like `serve`, with `settings.api_server_count` server processes. Returns the load
    error if the model failed to load; raises APIServerFailed if a server died."""
    count = settings.api_server_count
    sock = listen(host, port)
    log_like_uvicorn()

    def core_died(reason: str) -> None:
        logger.error("%s; every API server answers 503 until restarted", reason)

    def core_lost(rank: int, reason: str) -> None:
        logger.error("engine core %d died (%s); the other cores serve on", rank, reason)

    try:
        core = make_client(settings.engine_config, core_died, core_lost, api_servers=count)
    except BaseException as exc:  # noqa: BLE001 - the same one-line errors as one server
        sock.close()
        return exc
    info = core.info
    size = core.size
    attachments = [core.attachments_of(server) for server in range(count)]
    pids = [process.pid for process in core.processes]
    logger.info(
        "model %s loaded (%s, %d KV blocks) in %s (pid %s); starting %d API servers",
        settings.served_model_name or info.model_name,
        info.device,
        info.num_blocks,
        "the engine core" if size == 1 else f"{size} data-parallel engine cores",
        ", ".join(map(str, pids)),
        count,
    )
    logger.info("%s", info.scheduler_note)
    metrics_dir = tempfile.mkdtemp(prefix="vllm-rlt-metrics-")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir  # inherited by the servers
    spawn = multiprocessing.get_context("spawn")
    servers = [
        spawn.Process(
            target=run_api_server,
            args=(settings, sock, joined, host, port, shutdown_timeout, os.getpid()),
            name=f"vllm-rlt-api-server-{joined[0].client}",
        )
        for joined in attachments
    ]
    try:
        for server in servers:
            server.start()
        sock.close()  # the servers hold it now
        failed = _supervise(servers)
    finally:
        for server in servers:
            if server.is_alive():
                server.terminate()
            server.join(10)
            if server.is_alive():
                server.kill()
        core.shutdown()
        shutil.rmtree(metrics_dir, ignore_errors=True)
    if failed is not None:
        raise APIServerFailed(failed)
    return None


def _supervise(servers: list[multiprocessing.process.BaseProcess]) -> str | None:
    """Wait for SIGTERM/SIGINT (then drain every server) or a server's death (then stop
    the others); why a server died, or None after a clean stop."""
    stopping = threading.Event()

    def stop(*_) -> None:
        if not stopping.is_set():
            stopping.set()
            for server in servers:
                if server.is_alive():
                    os.kill(server.pid, signal.SIGTERM)  # type: ignore[arg-type]

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    failure = None
    try:
        running = {server.sentinel: server for server in servers}
        while running:
            for sentinel in multiprocessing.connection.wait(list(running), SUPERVISE_TICK_S):
                server = running.pop(sentinel)  # type: ignore[call-overload]
                server.join()
                # a server still starting when asked to stop dies of the SIGTERM itself
                stopped = stopping.is_set() and server.exitcode in (0, -signal.SIGTERM)
                if not stopped:
                    failure = failure or f"{server.name} exited with code {server.exitcode}"
                    logger.error("%s; stopping the server", failure)
                    stop()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return failure


def run_api_server(
    settings: ServerSettings,
    sock: socket.socket,
    attachments: list[CoreAttachment],
    host: str,
    port: int,
    shutdown_timeout: float,
    parent_pid: int,
) -> None:
    """Entry point of one API-server process."""
    # The main process turns Ctrl+C into SIGTERM for each server: one signal, one drain.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    leave_with_parent(parent_pid)
    log_like_uvicorn()
    state = ServerState(settings, attach=attachments)
    state.load()
    if state.load_error is not None:
        raise SystemExit(1)
    freeze_startup_heap()
    server = build_server(
        state,
        host,
        port,
        shutdown_timeout,
        stop_signals=(signal.SIGTERM,),
        announce=attachments[0].client == 1,
    )
    try:
        server.run(sockets=[sock])
    finally:
        state.engine.shutdown()  # type: ignore[union-attr]
