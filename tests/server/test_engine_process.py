"""The engine core in its own process: deaths on either side, cancellation floods, and the
metrics the core's counters feed."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.server.conftest import (
    _free_port,
    core_pid,
    process_exists,
    running_server,
    wait_healthy,
    wait_idle,
)
from vllm_rlt.engine.engine_args import EngineArgs
from vllm_rlt.engine.process.pass_rate import PassRate

LONG = {"model": "toy", "prompt": "long", "max_tokens": 4000, "ignore_eos": True}


def metric(url: str, name: str) -> float:
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith((name + " ", name + "{")):
            return float(line.split()[-1])
    raise AssertionError(f"{name} not in /metrics")


def test_killing_the_core_mid_stream_fails_every_request_and_health():
    """SIGKILL the core while a stream runs and another request waits: the stream ends
    with an error event, the waiting one gets an error object, /health turns 503, new
    requests get 503, and no process is left behind."""
    with running_server(max_num_seqs=1) as (url, state):
        process = state.engine.client.process
        assert process is not None and process.is_alive()

        async def scenario() -> tuple[list[str], httpx.Response]:
            async with httpx.AsyncClient(base_url=url, timeout=120) as http:
                waiting = asyncio.ensure_future(http.post("/v1/completions", json=LONG))
                events: list[str] = []
                body = {**LONG, "stream": True}
                async with http.stream("POST", "/v1/completions", json=body) as reply:
                    async for line in reply.aiter_lines():
                        if not line.startswith("data: "):
                            continue
                        if not events:
                            os.kill(process.pid, signal.SIGKILL)
                        events.append(line)
                return events, await waiting

        events, waiting = asyncio.run(scenario())
        assert '"error"' in events[-2] and "engine core process died" in events[-2]
        assert events[-1] == "data: [DONE]"
        assert waiting.status_code == 503
        assert "SIGKILL" in waiting.json()["error"]["message"]
        assert httpx.get(f"{url}/health").status_code == 503
        reply = httpx.post(f"{url}/v1/completions", json={"model": "toy", "prompt": "x"})
        assert reply.status_code == 503 and reply.json()["error"]["type"] == "service_unavailable"
        process.join(30)
        assert not process.is_alive()


def test_the_core_exits_when_its_frontend_is_killed():
    port = _free_port()
    root = Path(__file__).resolve().parents[2]
    server = subprocess.Popen(
        [sys.executable, "-m", "vllm_rlt.entrypoints.cli", "serve", "toy", "--port", str(port)],
        cwd=root,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        wait_healthy(f"http://127.0.0.1:{port}", server)
        log = ""
        while "engine core (pid" not in log:
            line = server.stderr.readline()  # the ready line precedes a healthy /health
            assert line, f"the server's log ended early:\n{log}"
            log += line
        pid = core_pid(log)
        assert process_exists(pid)
        server.kill()
        server.wait()
        deadline = time.monotonic() + 60
        while process_exists(pid):
            assert time.monotonic() < deadline, "the engine core outlived its frontend"
            time.sleep(0.05)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()


def test_a_cancellation_flood_leaves_every_block_free():
    """Many streams, every one dropped at a random point (some before their first token):
    the core, asked over its control channel, holds no request, block or slot after."""
    with running_server(max_num_seqs=16, num_blocks=256) as (url, state):
        rng = random.Random(0)

        async def one(http: httpx.AsyncClient, index: int) -> None:
            body = {**LONG, "prompt": f"flood {index}", "max_tokens": 200, "stream": True}
            keep = rng.randrange(0, 6)
            async with http.stream("POST", "/v1/completions", json=body) as reply:
                seen = 0
                async for line in reply.aiter_lines():
                    if line.startswith("data: "):
                        seen += 1
                        if seen > keep:
                            return  # leaving the block closes the connection

        async def flood() -> None:
            async with httpx.AsyncClient(base_url=url, timeout=120) as http:
                tasks = [asyncio.ensure_future(one(http, i)) for i in range(96)]
                await asyncio.sleep(0.05)
                for task in tasks[::3]:
                    task.cancel()  # a third leave whenever they are, queued or running
                await asyncio.gather(*tasks, return_exceptions=True)

        asyncio.run(flood())
        wait_idle(state)
        stats = state.engine.engine_stats()
        assert stats.num_requests == 0 and stats.num_free_blocks == stats.num_blocks
        assert httpx.get(f"{url}/health").status_code == 200


def test_pass_metrics_match_the_cores_own_counts():
    """vllm_rlt:passes equals the passes the core counted; rows per pass is a mean of real
    passes (or 0 once the window holds none)."""
    with running_server(max_num_seqs=4) as (url, state):
        before = state.engine.engine_stats()
        body = {"model": "toy", "prompt": ["a", "bb", "ccc"], "max_tokens": 12}
        assert httpx.post(f"{url}/v1/completions", json=body, timeout=120).status_code == 200
        wait_idle(state)
        after = state.engine.engine_stats()
        passes = after.num_passes - before.num_passes
        assert passes > 0
        assert metric(url, "vllm_rlt:passes_total") == after.num_passes
        # The CPU has no graphs: every pass ran eagerly.
        assert metric(url, "vllm_rlt:decode_graph_passes_total") == 0
        assert metric(url, "vllm_rlt:prompt_graph_passes_total") == 0
        rows_per_pass = metric(url, "vllm_rlt:rows_per_pass")
        assert rows_per_pass == 0 or 1 <= rows_per_pass <= after.num_rows
        assert metric(url, "vllm_rlt:num_preemptions_total") == 0
        assert metric(url, "vllm_rlt:num_requests_running") == 0


def test_pass_rate_covers_its_window_and_reads_zero_when_idle():
    now = [100.0]
    rate = PassRate(window=5.0, clock=lambda: now[0])
    for _ in range(10):  # 10 s at 20 passes of 30 rows per second
        now[0] += 1.0
        passes, rows = _advance(rate, 20, 30)
    assert rate.passes_per_second() == pytest.approx(20.0, rel=0.01)
    assert rate.rows_per_pass() == pytest.approx(30.0)
    now[0] += 60.0  # idle: nothing recorded
    assert rate.passes_per_second() < 2.0
    rate.record(passes, rows)
    assert rate.passes_per_second() == 0.0 and rate.rows_per_pass() == 0.0


def _advance(rate: PassRate, passes: int, rows_per_pass: int) -> tuple[int, int]:
    total_passes = rate._samples[-1][1] + passes
    total_rows = rate._samples[-1][2] + passes * rows_per_pass
    rate.record(total_passes, total_rows)
    return total_passes, total_rows


def test_an_api_server_joins_a_core_that_connects_at_once(monkeypatch):
    """A running core retries its connection to an API server's sockets and may get in as
    soon as they are bound; joining must notice a connection made before it starts to wait
    (it watches from before the bind)."""
    from vllm_rlt.engine.process.core_client import EngineCoreClient

    deaths = []
    core = EngineCoreClient(
        EngineArgs(model="toy").create_engine_config(), deaths.append, api_servers=1
    )
    try:
        wait = EngineCoreClient._wait_connected

        def late_wait(self, timeout: float = 60.0) -> None:
            time.sleep(1.0)  # the core connects meanwhile
            wait(self, timeout=20.0)

        monkeypatch.setattr(EngineCoreClient, "_wait_connected", late_wait)
        joined = EngineCoreClient.attach(core.attachments[0], deaths.append)
        assert joined.call("stats").num_requests == 0
        joined.shutdown()
    finally:
        core.shutdown()
    assert deaths == []


def test_a_call_behind_a_long_one_keeps_its_own_limit():
    """A control call waits for one in flight (a trainer's rendezvous can take minutes) no
    longer than its own timeout, so /metrics' short call never piles up threads."""
    from vllm_rlt.engine.process.core_client import EngineCoreClient

    core = EngineCoreClient(EngineArgs(model="toy").create_engine_config(), lambda _: None)
    try:
        assert core.call("stats").num_requests == 0
        core._call_lock.acquire()  # the long call in flight
        try:
            with pytest.raises(TimeoutError, match="busy with another call"):
                core.call("stats", timeout=0.2)
        finally:
            core._call_lock.release()
        assert core.call("stats").num_requests == 0
    finally:
        core.shutdown()


def test_a_join_that_waits_for_its_trainer_holds_no_other_call_nor_the_shutdown():
    """init_weights_update_group for a trainer that never comes waits up to the group's
    10-minute timeout: the core joins on a thread and answers at once, so other calls
    (stats, a second join: refused) go between the frontend's status asks, and a shutdown
    stops the core itself (exit code 0) instead of killing it once its waits run out."""
    import json

    from tests.unit.test_weight_sync import free_port
    from vllm_rlt.engine.process.core_client import EngineCoreClient
    from vllm_rlt.engine.weight_sync import JOIN_STATUS

    core = EngineCoreClient(EngineArgs(model="toy").create_engine_config(), lambda _: None)
    group = {"master_address": "127.0.0.1", "master_port": free_port(), "world_size": 2}
    join = "init_weights_update_group:" + json.dumps({**group, "rank_offset": 1})
    try:
        assert core.call(join, timeout=30) == {"joining": True}
        assert core.call("stats", timeout=30).num_requests == 0
        assert core.call(JOIN_STATUS, timeout=30) == {"joining": True}
        again = core.call(join, timeout=30)
        assert "already under way" in again["error"] and again["param"] == "master_address"
    finally:
        core.shutdown(timeout=20)
    assert core.process.exitcode == 0, f"the core was stopped by force: {core.process.exitcode}"
