"""`vllm-rlt serve --api-server-count 2`: two API-server processes in front of one engine
core. Outputs equal the offline engine's, /metrics sums both servers, and every death
(core, one server, the main process) ends cleanly with nothing left behind."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager

import httpx

from tests.server.conftest import (
    check_concurrent_streams,
    core_pid,
    process_exists,
    serve_process,
)

_SERVER_PID = re.compile(r"API server \d+ of \d+ ready \(pid (\d+)\)")


@contextmanager
def two_servers():
    """The real command line, in a subprocess; yields (url, process, pids)."""
    flags = ("--api-server-count", "2", "--shutdown-timeout", "5")
    with serve_process(*flags) as (process, url):
        log = ""
        while len(_SERVER_PID.findall(log)) < 2 or "engine core (pid" not in log:
            line = process.stderr.readline()
            assert line, f"the server's log ended early:\n{log}"
            log += line
        pids = {"core": core_pid(log), "servers": [int(p) for p in _SERVER_PID.findall(log)]}
        yield url, process, pids


def wait_gone(pids: list[int], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while any(process_exists(pid) for pid in pids):
        assert time.monotonic() < deadline, f"still running: {pids}"
        time.sleep(0.05)


def metric(url: str, name: str) -> float:
    """The sum of a metric's samples over all its labels."""
    values = [
        float(line.split()[-1])
        for line in httpx.get(f"{url}/metrics").text.splitlines()
        if line.startswith((name + " ", name + "{"))
    ]
    assert values, f"{name} not in /metrics"
    return sum(values)


def test_two_api_servers_equal_offline_and_sum_their_metrics_then_survive_a_dead_core():
    with two_servers() as (url, process, pids):
        offline = check_concurrent_streams(url, 32, max_tokens=10)

        # Every scrape, whichever server answers it, counts the requests of both.
        for _ in range(4):
            assert metric(url, "vllm_rlt:request_success_total") == 32
            generated = sum(len(output.outputs[0].token_ids) for output in offline)
            assert metric(url, "vllm_rlt:generation_tokens_total") == generated
        assert metric(url, "vllm_rlt:passes_total") > 0
        # and says which server served each request
        served = [
            line
            for line in httpx.get(f"{url}/metrics").text.splitlines()
            if line.startswith("vllm_rlt:api_server_requests_total{")
        ]
        assert served and all(re.search(r'api_server="[12]"', line) for line in served)
        assert metric(url, "vllm_rlt:api_server_requests_total") == 32
        assert metric(url, "vllm_rlt:num_requests_running") == 0

        os.kill(pids["core"], signal.SIGKILL)
        deadline = time.monotonic() + 30
        while httpx.get(f"{url}/health").status_code != 503:
            assert time.monotonic() < deadline, "/health stayed 200 without a core"
            time.sleep(0.05)
        for _ in range(6):  # each connection may reach either server: both know
            reply = httpx.post(f"{url}/v1/completions", json={"model": "toy", "prompt": "x"})
            assert reply.status_code == 503
            assert httpx.get(f"{url}/health").status_code == 503

        process.send_signal(signal.SIGTERM)
        code = process.wait(120)
        assert code == 0, process.stderr.read()
        wait_gone(pids["servers"])


def test_a_dead_api_server_stops_the_whole_server():
    with two_servers() as (url, process, pids):
        os.kill(pids["servers"][0], signal.SIGKILL)
        code = process.wait(120)
        log = process.stderr.read()
        assert code == 1, log
        assert "exited with code -9" in log, log
        wait_gone([pids["core"], *pids["servers"]])


def test_the_core_and_the_servers_exit_when_the_main_process_is_killed():
    with two_servers() as (url, process, pids):
        process.kill()
        process.wait()
        wait_gone([pids["core"], *pids["servers"]])


def test_api_server_count_out_of_range_is_a_one_line_error():
    reply = subprocess.run(
        [sys.executable, "-m", "vllm_rlt.entrypoints.cli", "serve", "toy"]
        + ["--api-server-count", "0"],
        capture_output=True,
        text=True,
    )
    assert reply.returncode == 2
    assert "--api-server-count must be in [1, 64], got 0" in reply.stderr


def _wait_forever() -> None:
    """An API server that has not installed its signal handlers yet."""
    threading.Event().wait()


def test_a_server_still_starting_when_stopped_is_no_failure():
    """SIGTERM to the supervisor reaches a server before its own handler is in place: it
    dies of the signal, which is the stop asked for, not a failure (exit code 0 then)."""
    import multiprocessing

    from vllm_rlt.entrypoints.openai.api_servers import _supervise

    server = multiprocessing.get_context("spawn").Process(target=_wait_forever)
    server.start()
    killer = threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGTERM))
    killer.start()
    try:
        assert _supervise([server]) is None
    finally:
        killer.cancel()
        server.kill()
        server.join()
    assert server.exitcode == -signal.SIGTERM
