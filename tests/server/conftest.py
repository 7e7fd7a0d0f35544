"""A real server on a loopback port, in this process, with the built-in toy model: the same
app, connection limits and protocol as `vllm-rlt serve`."""

from __future__ import annotations

import socket
import subprocess
import threading
import time
from contextlib import contextmanager

import httpx
import pytest

from vllm_rlt import CacheConfig, SchedulerConfig
from vllm_rlt.entrypoints.openai.server import ServerSettings, ServerState, build_server


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def running_server(num_blocks: int = 512, max_num_seqs: int = 64, **settings):
    llm_kwargs = {
        "model": "toy",
        "cache_config": CacheConfig(num_blocks=num_blocks),
        "scheduler_config": SchedulerConfig(max_num_seqs=max_num_seqs),
    }
    state = ServerState(ServerSettings(llm_kwargs=llm_kwargs, **settings))
    state.load()
    assert state.load_error is None, state.load_error
    port = _free_port()
    server = build_server(state, "127.0.0.1", port, drain_timeout=5.0, log_level="warning")
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline, "server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}", state
    finally:
        server.should_exit = True
        thread.join(timeout=20)
        state.engine.shutdown()


def wait_healthy(url: str, process: subprocess.Popen, timeout: float = 120.0) -> None:
    """Until the server a subprocess runs answers /health with 200 (it may be loading)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if httpx.get(f"{url}/health").status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert process.poll() is None, f"the server exited with {process.returncode}"
        assert time.monotonic() < deadline, "server did not come up"
        time.sleep(0.1)


def wait_idle(state: ServerState, timeout: float = 10.0) -> None:
    """Until the engine holds no request and every KV block is free."""
    engine = state.engine.engine
    deadline = time.monotonic() + timeout
    while engine.has_unfinished or not engine.all_blocks_free():
        assert time.monotonic() < deadline, "engine did not go idle"
        time.sleep(0.02)


@pytest.fixture(scope="module")
def server():
    with running_server() as running:
        yield running
