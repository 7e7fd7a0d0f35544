"""`bench serve --launch`: the server under test, started on a free loopback port, waited
for, and stopped (see bench/serve.py)."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import IO, Any

from vllm_rlt.bench.serve_client import BenchFailed, run_async
from vllm_rlt.cli_parser import CLIParser
from vllm_rlt.entrypoints.args import add_engine_args
from vllm_rlt.entrypoints.cli import add_server_args

HOST = "127.0.0.1"
READY_TIMEOUT_S = 600.0  # loading a large checkpoint and building its KV pool takes minutes
STOP_TIMEOUT_S = 60.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return sock.getsockname()[1]


def relay(stream: IO[str]) -> None:
    """Copy the launched server's output to our stderr, line by line."""
    for line in stream:
        sys.stderr.write(line)
        sys.stderr.flush()


def wait_ready(url: str, process: subprocess.Popen, timeout: float = READY_TIMEOUT_S) -> float:
    """Seconds until GET /health answered 200; fails at once if the process exits first."""
    import aiohttp  # the serve extra's (bench serve checks for it after its --help)

    async def poll() -> float:
        began = time.perf_counter()
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as http:
            while True:
                code = process.poll()
                if code is not None:
                    raise BenchFailed(
                        f"the launched server exited with code {code} before it was ready",
                        code or 1,
                    )
                try:
                    async with http.get(f"{url}/health") as reply:
                        if reply.status == 200:
                            return time.perf_counter() - began
                except (aiohttp.ClientError, OSError, asyncio.TimeoutError):
                    pass  # not listening yet
                if time.perf_counter() - began > timeout:
                    raise BenchFailed(f"the launched server was not ready within {timeout:g} s")
                await asyncio.sleep(0.25)

    return run_async(poll())


def stop(process: subprocess.Popen) -> int:
    """SIGTERM, then SIGKILL if it has not exited in time; its exit code."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    return process.returncode


@contextmanager
def launched(command: list[str], extra: list[str], info: dict[str, Any]) -> Iterator[str]:
    """Run `python -m <command> <extra> --host 127.0.0.1 --port <free>` until the block ends;
    yields its URL once it is ready. The address comes last, so that it is the one used."""
    port = free_port()
    argv = [sys.executable, "-m", *command, *extra, "--host", HOST, "--port", str(port)]
    process = subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        errors="replace",
        env={**os.environ, "PYTHONUNBUFFERED": "1"},  # its lines reach us as they are written
    )
    assert process.stdout is not None
    relaying = threading.Thread(target=relay, args=(process.stdout,), daemon=True)
    relaying.start()
    try:
        url = f"http://{HOST}:{port}"
        info["ready_s"] = wait_ready(url, process)
        yield url
    finally:
        info["exit_code"] = stop(process)
        relaying.join(timeout=10)


def server_flags_parser() -> CLIParser:
    """The server's own flags, to read what the engine (and the bench) must know of them."""
    parser = CLIParser(prog="vllm-rlt bench serve (server flags after --)", add_help=False)
    add_engine_args(parser)
    add_server_args(parser)
    return parser
