"""`vllm-rlt serve --data-parallel-size 2`: two engine cores behind one server. Outputs equal
the offline engine's request for request, both cores serve, /metrics labels each core, and a
core that dies fails only its own requests: the other core serves on, /health answers 503
naming the lost core, and nothing is left hanging."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from tests.server.conftest import (
    _free_port,
    check_concurrent_streams,
    log_until,
    process_exists,
    running_server,
    serve_process,
    stream_end,
)
from vllm_rlt.engine.process.dp_client import DataParallelClient
from vllm_rlt.engine.process.messages import AddRequest
from vllm_rlt.entrypoints.cli import main
from vllm_rlt.sampling_params import SamplingParams

_CORE_PIDS = re.compile(r"2 data-parallel engine cores \(pid (\d+), (\d+)\)")


def samples(url: str, name: str, api_key: str | None = None) -> dict[str, float]:
    """A metric's value per `engine` label."""
    values = {}
    headers = {} if api_key is None else {"Authorization": f"Bearer {api_key}"}
    for line in httpx.get(f"{url}/metrics", headers=headers).text.splitlines():
        if line.startswith(name + "{"):
            engine = re.search(r'engine="(\d+)"', line)
            assert engine, line
            values[engine.group(1)] = float(line.split()[-1])
    return values


def _long_streams(url: str, count: int, stop: threading.Event) -> list[threading.Thread]:
    """`count` streaming requests that run until `stop` is set (then they disconnect)."""
    body = {"model": "toy", "prompt": "go", "max_tokens": 3000, "ignore_eos": True}

    def stream() -> None:
        with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}) as r:
            for _ in r.iter_lines():
                if stop.is_set():
                    return

    threads = [threading.Thread(target=stream) for _ in range(count)]
    for thread in threads:
        thread.start()
    return threads


def _finite_streams(url: str, count: int, max_tokens: int, ends: list[str]):
    """`count` streaming requests of `max_tokens` tokens; each appends how it ended to
    `ends`: its finish reason, or "error" for an error event."""
    body = {"model": "toy", "prompt": "go", "max_tokens": max_tokens, "ignore_eos": True}

    def stream() -> None:
        with httpx.stream(
            "POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=120
        ) as r:
            if r.status_code != 200:  # failed before its first event: a plain error reply
                ends.append("error")
                return
            end = stream_end(r.read())
            if end is not None:
                ends.append(end)

    threads = [threading.Thread(target=stream) for _ in range(count)]
    for thread in threads:
        thread.start()
    return threads


def _health_until(url: str, status: int, timeout: float = 30.0) -> httpx.Response:
    deadline = time.monotonic() + timeout
    while (health := httpx.get(f"{url}/health")).status_code != status:
        assert time.monotonic() < deadline, f"/health never answered {status}"
        time.sleep(0.05)
    return health


def test_two_cores_equal_offline_label_their_metrics_and_a_dead_core_is_named():
    flags = ("--data-parallel-size", "2", "--shutdown-timeout", "5", "--stall-timeout", "2")
    with serve_process(*flags) as (process, url):
        log = log_until(process, _CORE_PIDS.search)
        pids = [int(pid) for pid in _CORE_PIDS.search(log).groups()]

        check_concurrent_streams(url, 24, max_tokens=10)
        passes = samples(url, "vllm_rlt:passes_total")
        assert set(passes) == {"0", "1"} and all(value > 0 for value in passes.values())
        assert sum(samples(url, "vllm_rlt:num_requests_running").values()) == 0

        # A core that stops moving while it has work: /health names it, then recovers.
        stop = threading.Event()
        streams = _long_streams(url, 2, stop)  # one on each core
        deadline = time.monotonic() + 60
        while min(samples(url, "vllm_rlt:num_requests_running").values()) < 1:
            assert time.monotonic() < deadline, "the two streams did not reach both cores"
            time.sleep(0.05)
        os.kill(pids[1], signal.SIGSTOP)
        try:
            health = _health_until(url, 503)
            assert health.json() == {
                "status": "stalled",
                "reason": "engine core 1 made no progress for 2 s",
            }
        finally:
            os.kill(pids[1], signal.SIGCONT)
        _health_until(url, 200)
        stop.set()
        for thread in streams:
            thread.join(60)

        # A core that dies fails only its own streams: the other core's finish, new
        # requests go to it, and /health names the lost core with 503.
        ends: list[str] = []
        streams = _finite_streams(url, 8, 400, ends)
        deadline = time.monotonic() + 60
        while True:
            running = samples(url, "vllm_rlt:num_requests_running").values()
            if sum(running) == 8 and min(running) >= 1:
                break
            assert time.monotonic() < deadline, "the streams did not all run, on both cores"
            time.sleep(0.05)
        os.kill(pids[1], signal.SIGKILL)
        for thread in streams:
            thread.join(120)
        # core 1's streams end with an error event, core 0's run to their length
        assert len(ends) == 8 and {"error", "length"} == set(ends), ends
        health = _health_until(url, 503)
        assert health.json()["status"] == "degraded"
        assert "engine core 1 (of 2)" in health.json()["reason"]
        for _ in range(4):
            reply = httpx.post(
                f"{url}/v1/completions",
                json={"model": "toy", "prompt": "x", "max_tokens": 3, "ignore_eos": True},
            )
            assert reply.status_code == 200, reply.text
            assert reply.json()["usage"]["completion_tokens"] == 3
        assert set(samples(url, "vllm_rlt:passes_total")) == {"0"}

        process.send_signal(signal.SIGTERM)
        code = process.wait(120)
        assert code == 0, process.stderr.read()
        deadline = time.monotonic() + 60
        while process_exists(pids[0]):
            assert time.monotonic() < deadline, "core 0 outlived the server"
            time.sleep(0.05)


def test_two_cores_behind_two_api_servers_equal_offline_and_both_serve():
    """Each API server joins both cores: every request is answered as the offline engine
    would, both cores serve, /metrics counts every request once whichever server took it,
    a killed core turns /health to 503 naming it, and SIGTERM leaves no process behind."""
    flags = ("--data-parallel-size", "2", "--api-server-count", "2", "--shutdown-timeout", "5")
    ready = re.compile(r"API server \d+ of 2 ready \(pid (\d+)\)")
    with serve_process(*flags) as (process, url):
        log = log_until(
            process, lambda log: len(ready.findall(log)) == 2 and _CORE_PIDS.search(log)
        )
        pids = [int(pid) for pid in _CORE_PIDS.search(log).groups()]
        pids += [int(pid) for pid in ready.findall(log)]

        check_concurrent_streams(url, 32, max_tokens=10)
        passes = samples(url, "vllm_rlt:passes_total")
        assert set(passes) == {"0", "1"} and all(value > 0 for value in passes.values())
        served = {}
        for line in httpx.get(f"{url}/metrics").text.splitlines():
            if line.startswith("vllm_rlt:api_server_requests_total{"):
                server = re.search(r'api_server="(\d+)"', line).group(1)
                served[server] = served.get(server, 0) + float(line.split()[-1])
        assert sum(served.values()) == 32

        # A dead core is named (every server watches the lifeline of every core).
        os.kill(pids[1], signal.SIGKILL)
        for _ in range(4):
            health = _health_until(url, 503)
            assert "engine core 1 (of 2)" in health.json()["reason"]

        process.send_signal(signal.SIGTERM)
        code = process.wait(120)
        assert code == 0, process.stderr.read()
        deadline = time.monotonic() + 60
        while any(process_exists(pid) for pid in pids):
            assert time.monotonic() < deadline, "a core or an API server outlived the server"
            time.sleep(0.05)


def _descendants(pid: int) -> list[int]:
    """Every process below `pid` (Linux /proc)."""
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as stat:
                    fields = stat.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            parents[int(entry)] = int(fields[1])
    found, frontier = [], [pid]
    while frontier:
        parent = frontier.pop()
        children = [child for child, ppid in parents.items() if ppid == parent]
        found += children
        frontier += children
    return found


def test_two_cores_of_two_tensor_parallel_ranks_equal_offline():
    """Data parallel over tensor parallel: each core splits the model over two processes
    of its own; streams equal the one-process offline engine's, both cores serve, and
    SIGTERM ends every process."""
    flags = ("--data-parallel-size", "2", "--tensor-parallel-size", "2")
    with serve_process(*flags, "--shutdown-timeout", "5") as (process, url):
        check_concurrent_streams(url, 8, max_tokens=8)
        passes = samples(url, "vllm_rlt:passes_total")
        assert set(passes) == {"0", "1"} and all(value > 0 for value in passes.values())
        below = _descendants(process.pid)
        process.send_signal(signal.SIGTERM)
        assert process.wait(120) == 0, process.stderr.read()
        deadline = time.monotonic() + 60
        while any(process_exists(pid) for pid in below):
            assert time.monotonic() < deadline, "a core or a rank outlived the server"
            time.sleep(0.05)


def _free_ports(count: int) -> int:
    """The first of `count` consecutive free ports."""
    while True:
        first = _free_port()
        sockets = []
        try:
            for port in range(first, first + count):
                sock = socket.socket()
                sockets.append(sock)
                sock.bind(("127.0.0.1", port))
            return first
        except OSError:
            continue
        finally:
            for sock in sockets:
                sock.close()


def _headless(rpc_port: int, api_key: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "vllm_rlt.entrypoints.cli", "serve", "toy", "--headless"]
        + ["--data-parallel-size", "2", "--data-parallel-size-local", "1"]
        + ["--data-parallel-start-rank", "1", "--data-parallel-rpc-port", str(rpc_port)]
        + ["--api-key", api_key],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_a_core_on_another_host_joins_with_the_api_key_and_its_death_is_named():
    """The frontend runs core 0, a `--headless` process core 1 over the encrypted TCP
    channel on loopback: outputs equal offline, both cores serve, an engine with another
    API key is refused without disturbing anything, and killing the headless host turns
    /health to 503 naming core 1."""
    rpc_port = _free_ports(6)  # rank 1's three ports start at rpc_port + 3
    remote = _headless(rpc_port, "x")
    try:
        flags = ("--data-parallel-size", "2", "--data-parallel-size-local", "1")
        flags += ("--data-parallel-rpc-port", str(rpc_port), "--api-key", "x")
        with serve_process(*flags, "--shutdown-timeout", "5") as (process, url):
            check_concurrent_streams(url, 24, max_tokens=10)
            passes = samples(url, "vllm_rlt:passes_total", api_key="x")
            assert set(passes) == {"0", "1"} and all(value > 0 for value in passes.values())

            intruder = _headless(rpc_port, "not the key")
            assert intruder.wait(120) == 1
            assert "refused this engine's encrypted handshake" in intruder.stderr.read()
            assert httpx.get(f"{url}/health").status_code == 200

            remote.kill()  # its core follows its parent out within a second
            deadline = time.monotonic() + 30
            while (health := httpx.get(f"{url}/health")).status_code != 503:
                assert time.monotonic() < deadline, "/health stayed 200 without core 1"
                time.sleep(0.05)
            assert "engine core 1 (of 2)" in health.json()["reason"]
            process.send_signal(signal.SIGTERM)
            assert process.wait(120) == 0, process.stderr.read()
    finally:
        remote.kill()
        remote.wait()


def test_a_headless_host_leaves_when_its_frontend_is_gone():
    """SIGKILL of the frontend: the headless engine notices the closed connection and
    leaves, and its process exits 1 so that a supervisor can restart it."""
    rpc_port = _free_ports(6)
    remote = _headless(rpc_port, "x")
    try:
        flags = ("--data-parallel-size", "2", "--data-parallel-size-local", "1")
        flags += ("--data-parallel-rpc-port", str(rpc_port), "--api-key", "x")
        with serve_process(*flags) as (process, _):
            process.kill()
        assert remote.wait(120) == 1
        assert "went away" in remote.stderr.read()
    finally:
        remote.kill()
        remote.wait()


def test_data_parallel_flags_out_of_range_are_one_line_errors(monkeypatch, capsys):
    cases = [
        (["--data-parallel-size", "0"], "--data-parallel-size must be in [1, 64], got 0"),
        (
            ["--data-parallel-size", "2", "--data-parallel-size-local", "1"]
            + ["--api-server-count", "2", "--api-key", "k"],
            "data-parallel cores on other hosts run with one API server: --api-server-count 2 "
            "needs --data-parallel-size-local equal to --data-parallel-size (2)",
        ),
        (
            ["--data-parallel-size", "2", "--device", "cuda:1"],
            "data parallelism gives each core its own GPUs: use device 'cuda', not 'cuda:1'",
        ),
        (
            ["--data-parallel-size", "2", "--device", "cuda"],
            "data_parallel_size 2 needs 2 GPUs, but 1 is visible",
        ),
        (
            ["--data-parallel-size", "2", "--tensor-parallel-size", "2", "--device", "cuda"],
            "data_parallel_size 2 x tensor_parallel_size 2 needs 4 GPUs, but 1 is visible",
        ),
        (
            ["--data-parallel-size", "2", "--data-parallel-size-local", "1"],
            "cores on other hosts need --api-key",
        ),
        (
            ["--data-parallel-size", "2", "--data-parallel-size-local", "3"],
            "--data-parallel-size-local must be in [0, 2], got 3",
        ),
        (
            ["--headless", "--data-parallel-size", "2", "--data-parallel-start-rank", "2"],
            "--data-parallel-start-rank must be in [0, 0]",
        ),
        (
            ["--data-parallel-size", "2", "--data-parallel-size-local", "1", "--api-key", "k"]
            + ["--data-parallel-rpc-port", "65533"],
            "data_parallel_rpc_port must leave room for 3 ports per core: 65533 to 65538",
        ),
        (
            ["--headless", "--data-parallel-size", "2", "--data-parallel-size-local", "1"]
            + ["--api-key", "k", "--data-parallel-address", "bad..host"],
            "data_parallel_address 'bad..host' does not resolve",
        ),
    ]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")  # read, never opened: no CUDA is touched
    for flags, message in cases:
        with pytest.raises(SystemExit) as exit_info:
            main(["serve", "toy", *flags])
        error = capsys.readouterr().err
        assert exit_info.value.code == 2, (flags, error)
        assert message in error and error.count("\n") == 1, (flags, error)


class _Core:
    def __init__(self, slots: int) -> None:
        self.info = type("Info", (), {"max_num_seqs": slots})()
        self.client = 0
        self.sent: list = []
        self.dead = None  # called on a send that finds the core gone

    def send(self, command) -> bool:
        if self.dead is not None:
            self.dead()
            return False
        self.sent.append(command)
        return True


def test_a_request_goes_to_the_least_loaded_core():
    """Fewest sequences waiting beyond the core's slots first, then the lowest KV use,
    then the fewest sequences."""
    client = DataParallelClient.__new__(DataParallelClient)
    client.cores = [_Core(4), _Core(4)]
    client.lost = {}
    client._sequences = [0, 0]
    client._kv_usage = [0.0, 0.0]
    assert client.choose(1) == 0  # a tie goes to the first
    client._sequences = [1, 0]
    assert client.choose(1) == 1  # fewer sequences
    client._kv_usage = [0.1, 0.5]
    assert client.choose(1) == 0  # lower KV use beats fewer sequences while nobody waits
    client._sequences = [4, 1]
    assert client.choose(1) == 1  # core 0 would make one wait
    client._sequences = [6, 6]
    client._kv_usage = [0.9, 0.2]
    assert client.choose(2) == 1  # both would queue as many: KV use decides
    client.lost = {1: "killed"}
    assert client.choose(2) == 0  # a lost core gets nothing


def test_sleep_is_all_or_nothing_across_cores():
    """One core busy: /sleep is refused naming it, and the idle core, which slept, is
    awake again (/is_sleeping says so, and it serves). Idle: every core sleeps and wakes."""
    body = {"model": "toy", "prompt": "awake", "max_tokens": 3, "ignore_eos": True}
    with running_server(in_process=True, enable_sleep_mode=True, data_parallel_size=2) as (
        url,
        _,
    ):
        stop = threading.Event()
        streams = _long_streams(url, 1, stop)  # on core 0: a tie goes to the first
        deadline = time.monotonic() + 60
        while samples(url, "vllm_rlt:num_requests_running").get("0", 0) < 1:
            assert time.monotonic() < deadline, "the stream never ran"
            time.sleep(0.02)
        refused = httpx.post(f"{url}/sleep", timeout=60)
        assert refused.status_code == 409
        assert refused.json()["error"]["message"].startswith("engine core 0: sleep needs")
        assert httpx.get(f"{url}/is_sleeping").json() == {"is_sleeping": False}
        for _ in range(2):  # core 1 serves: it is awake
            reply = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
            assert reply.status_code == 200, reply.text
        stop.set()
        for thread in streams:
            thread.join(60)
        deadline = time.monotonic() + 60
        while sum(samples(url, "vllm_rlt:num_requests_running").values()):
            assert time.monotonic() < deadline, "the cores never went idle"
            time.sleep(0.02)
        assert httpx.post(f"{url}/sleep", timeout=60).json() == {"is_sleeping": True}
        assert httpx.get(f"{url}/is_sleeping").json() == {"is_sleeping": True}
        assert httpx.post(f"{url}/v1/completions", json=body).status_code == 400
        assert httpx.post(f"{url}/wake_up", timeout=60).json() == {"is_sleeping": False}
        assert httpx.post(f"{url}/v1/completions", json=body, timeout=60).status_code == 200


def test_a_request_sent_to_a_core_found_dead_goes_to_another():
    """The core a request was placed on turns out dead as it is sent (its death not yet
    noticed): the request goes to a live core, counted there only."""
    client = DataParallelClient.__new__(DataParallelClient)
    client._prepare(lambda reason: None, lambda rank, reason: None)
    client.cores = [_Core(4), _Core(4)]
    client._owner, client._sequences = {}, [0, 0]
    client._kv_usage, client._heard = [0.0, 0.0], [0.0, 0.0]
    client.cores[0].dead = lambda: client._core_died(0, "killed")
    params = SamplingParams(n=2)
    client.send(AddRequest("r", [1, 2], params, 0))
    assert client.lost == {0: "killed"}
    assert [c.request_id for c in client.cores[1].sent] == ["r"]
    assert client._owner == {"r": (1, 2)} and client._sequences == [0, 2]
    client.cores[1].dead = lambda: client._core_died(1, "killed")
    client.send(AddRequest("s", [1], params, 0))  # none left: it fails with the engine
    assert client.dead_reason is not None and client._owner["s"][0] == 1
