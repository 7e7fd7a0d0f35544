"""A real server on a loopback port with the built-in toy model: the same app, connection
limits, protocol and engine-core process as `vllm-rlt serve`, with the frontend in this
process. `in_process=True` runs the core on a thread instead, for tests that reach into
the engine."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

import httpx
import openai
import pytest

from vllm_rlt import LLM, CacheConfig, SamplingParams, SchedulerConfig
from vllm_rlt.engine.engine_args import EngineArgs
from vllm_rlt.entrypoints.openai.server import build_server
from vllm_rlt.entrypoints.openai.server_state import ServerState
from vllm_rlt.entrypoints.openai.settings import ServerSettings


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def running_server(
    num_blocks: int = 512,
    max_num_seqs: int = 64,
    in_process: bool = False,
    model: str = "toy",
    **settings,
):
    """`settings` are ServerSettings' fields, and EngineArgs' for the engine."""
    engine_fields = {f.name for f in dataclasses.fields(EngineArgs)}
    engine_args = EngineArgs(
        model=model,
        cache_config=CacheConfig(num_blocks=num_blocks),
        scheduler_config=SchedulerConfig(max_num_seqs=max_num_seqs),
        **{name: value for name, value in settings.items() if name in engine_fields},
    )
    server_settings = {name: value for name, value in settings.items() if name not in engine_fields}
    state = ServerState(
        ServerSettings(
            engine_config=engine_args.create_engine_config(),
            engine_in_process=in_process,
            **server_settings,
        )
    )
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


@contextmanager
def serve_process(*flags: str):
    """`vllm-rlt serve toy` in a subprocess, up and healthy; yields (process, url)."""
    port = _free_port()
    root = Path(__file__).resolve().parents[2]
    process = subprocess.Popen(
        [sys.executable, "-m", "vllm_rlt.entrypoints.cli", "serve", "toy", "--port", str(port)]
        + list(flags),
        cwd=root,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, process)
        yield process, url
    finally:
        if process.poll() is None:
            process.kill()
        process.wait()


def log_until(process: subprocess.Popen, done: Callable[[str], object]) -> str:
    """A served subprocess's stderr, read line by line until `done(log)` holds."""
    log = ""
    while not done(log):
        line = process.stderr.readline()
        assert line, f"the server's log ended early:\n{log}"
        log += line
    return log


def stream_end(body: bytes) -> str | None:
    """How a streamed completion's events end: "error" for an error event, else the first
    finish reason (None without one). Events split on blank lines only: generated text
    may hold other line breaks."""
    for event in body.split(b"\n\n"):
        if event.startswith(b"data: {"):
            data = json.loads(event[len(b"data: ") :])
            if "error" in data:
                return "error"
            reason = data["choices"][0].get("finish_reason")
            if reason is not None:
                return reason
    return None


def check_concurrent_streams(url: str, count: int, max_tokens: int = 12) -> list:
    """`count` streaming clients at once, each seeded; every streamed text must equal
    LLM.generate's with the same seed. Returns the offline outputs."""
    prompts = [f"prompt number {i} " * (1 + i % 3) for i in range(count)]
    params = dict(max_tokens=max_tokens, temperature=0.8, top_k=40)

    async def one(api: openai.AsyncOpenAI, index: int) -> str:
        stream = await api.completions.create(
            model="toy",
            prompt=prompts[index],
            seed=index,
            stream=True,
            max_tokens=params["max_tokens"],
            temperature=params["temperature"],
            extra_body={"top_k": params["top_k"]},
        )
        return "".join([choice.text async for chunk in stream for choice in chunk.choices])

    async def all_streams() -> list[str]:
        async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0) as api:
            return await asyncio.gather(*(one(api, i) for i in range(count)))

    streamed = asyncio.run(all_streams())
    offline = LLM(model="toy").generate(
        prompts, [SamplingParams(seed=i, **params) for i in range(count)], use_tqdm=False
    )
    assert streamed == [output.outputs[0].text for output in offline]
    return offline


def wait_idle(state: ServerState, timeout: float = 30.0) -> None:
    """Until the engine core holds no request and every KV block and slot is free, as the
    core itself reports over its control channel."""
    deadline = time.monotonic() + timeout
    while True:
        stats = state.engine.engine_stats()
        if not stats.has_unfinished and stats.all_blocks_free:
            assert stats.num_free_slots == state.engine.max_running, "slots leaked"
            return
        assert time.monotonic() < deadline, f"engine did not go idle: {stats}"
        time.sleep(0.02)


def core_engine(state: ServerState):
    """The EngineCore of a server started with in_process=True."""
    engine = state.engine.client.core_engine
    assert engine is not None, "start the server with in_process=True"
    return engine


ERROR_KEYS = {"message", "type", "param", "code"}  # an OpenAI error object's, no more
# A small valid body for each completion route; tests change a field of it.
BASES = {
    "/v1/completions": {"model": "toy", "prompt": "x", "max_tokens": 2},
    "/v1/chat/completions": {
        "model": "toy",
        "messages": [{"role": "user", "content": "x"}],
        "max_tokens": 2,
    },
}


def assert_error(reply: httpx.Response, status: int, param: str | None = None) -> dict:
    """The error object of an OpenAI-style error reply of `status` (naming `param` if given)."""
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert set(error) == ERROR_KEYS and error["code"] == status
    if param is not None:
        assert error["param"] == param, error
    return error


def assert_healthy(url: str) -> None:
    """The server is healthy and still completes a request."""
    assert httpx.get(f"{url}/health").status_code == 200
    body = {"model": "toy", "prompt": "still fine", "max_tokens": 3, "ignore_eos": True}
    reply = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert reply.status_code == 200 and reply.json()["choices"][0]["finish_reason"] == "length"


def wait_until(condition: Callable[[], object], timeout: float = 30.0) -> None:
    """Until `condition()` holds (polled)."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)


@pytest.fixture(scope="module")
def server():
    with running_server() as running:
        yield running


_CORE_PID = re.compile(r"engine core \(pid (\d+)\)")


def core_pid(log: str) -> int:
    """The engine-core pid from a server's log (its ready line names it)."""
    match = _CORE_PID.search(log)
    assert match, f"no engine core pid in the log:\n{log}"
    return int(match.group(1))


def process_exists(pid: int) -> bool:
    """True while `pid` runs (a zombie waiting to be reaped counts as gone)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True
    return "\nState:\tZ" not in status
