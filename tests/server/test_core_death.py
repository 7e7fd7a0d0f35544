"""An engine core killed while clients stream, some of them leaving at once (each departure
sends the dead core an abort): the server keeps answering. Every stream that stays ends
(an error event, or its last token from a core still running), /health answers 503 naming
the loss, a new request is served by a live core or refused at once, SIGTERM stops the
server, and no process or shared-memory pool is left. One core, two data-parallel cores,
and a disaggregated pair with either core killed, at several moments of a request's life."""

from __future__ import annotations

import asyncio
import glob
import os
import re
import signal
import time

import httpx
import pytest

from tests.server.conftest import log_until, process_exists, serve_process, stream_end
from tests.server.test_data_parallel import _descendants

_PIDS = re.compile(r"engine cores? \(pid ([\d, ]+)\)")
SHORT = {"model": "toy", "max_tokens": 40, "ignore_eos": True, "stream": True}
LEAVING = {**SHORT, "max_tokens": 3000}
# several blocks of 16 positions: with chunks of 16 its blocks move while later chunks run
LONG_PROMPT = "a prompt long enough to span several blocks of the cache " * 4


def _metric(url: str, name: str) -> float:
    """A metric summed over its labels (0 before it has a sample)."""
    total = 0.0
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith((name + " ", name + "{")):
            total += float(line.split()[-1])
    return total


def _moment_reached(url: str, moment: str) -> bool:
    if moment == "prefill":  # the long prompts are admitted, no request has moved yet
        return _metric(url, "vllm_rlt:num_requests_running") >= 1
    if moment == "early block moves":  # prompt blocks lent before their request's handover
        return _metric(url, "vllm_rlt:kv_transfer_prefetched_blocks_total") > 0
    if moment == "handover":
        return _metric(url, "vllm_rlt:kv_transfer_handovers_total") > 0
    assert moment == "decode"  # every short stream has tokens
    return _metric(url, "vllm_rlt:generation_tokens_total") >= 8 * 3


async def _stream(http: httpx.AsyncClient, body: dict, ends: list[str]) -> None:
    """One streaming completion; appends how it ended: "error" (an error event or reply)
    or its finish reason."""
    async with http.stream("POST", "/v1/completions", json=body) as reply:
        if reply.status_code != 200:
            ends.append("error")
            return
        body = await reply.aread()
    ends.append(stream_end(body) or f"no end: {body[-200:]!r}")


def _kill_while_clients_stream(url: str, victim: int, moment: str, long_prompts: bool):
    """Eight short streams that stay, four that leave 0.1 s after the kill, and four long
    prompts that stay; returns how the staying streams ended and /health's answers."""
    ends: list[str] = []

    async def scenario() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=url, timeout=120) as http:
            staying = [
                asyncio.ensure_future(_stream(http, {**SHORT, "prompt": f"stay {i}"}, ends))
                for i in range(8)
            ]
            if long_prompts:
                staying += [
                    asyncio.ensure_future(
                        _stream(http, {**SHORT, "prompt": f"{i} {LONG_PROMPT}"}, ends)
                    )
                    for i in range(4)
                ]
            leaving = [
                asyncio.ensure_future(_stream(http, {**LEAVING, "prompt": f"go {i}"}, []))
                for i in range(4)
            ]
            deadline = time.monotonic() + 120
            while not await asyncio.to_thread(_moment_reached, url, moment):
                assert time.monotonic() < deadline, f"the moment {moment!r} never came"
                await asyncio.sleep(0.01)
            os.kill(victim, signal.SIGKILL)
            await asyncio.sleep(0.1)
            for task in leaving:
                task.cancel()
            healths = []
            for _ in range(10):  # answered at once, also while the streams still end
                healths.append(await http.get("/health", timeout=2))
                await asyncio.sleep(0.05)
            done, hung = await asyncio.wait(staying, timeout=90)
            assert not hung, f"{len(hung)} streams never ended: {ends}"
            for task in done:
                task.result()
            return healths

    return ends, asyncio.run(scenario())


@pytest.mark.parametrize(
    "flags, victim, moment",
    [
        ((), 0, "decode"),
        (("--data-parallel-size", "2"), 1, "decode"),
        (("--disaggregate", "1:1"), 1, "early block moves"),
        (("--disaggregate", "1:1"), 1, "decode"),
        (("--disaggregate", "1:1"), 0, "prefill"),
        (("--disaggregate", "1:1"), 0, "handover"),
    ],
    ids=[
        "one-core",
        "data-parallel",
        "decode-core-early",
        "decode-core",
        "prefill-core-early",
        "prefill-core",
    ],
)
def test_a_killed_core_with_departing_clients_leaves_the_server_answering(flags, victim, moment):
    pools_before = set(glob.glob("/dev/shm/vllm-rlt-*"))
    if "--disaggregate" in flags:
        flags += ("--prefill-chunk-size", "16")
    with serve_process(*flags, "--shutdown-timeout", "5") as (process, url):
        log = log_until(process, _PIDS.search)
        pids = [int(pid) for pid in _PIDS.search(log).group(1).split(",")]
        everything = _descendants(process.pid)
        ends, healths = _kill_while_clients_stream(
            url, pids[victim], moment, long_prompts="--disaggregate" in flags
        )
        assert healths[-1].status_code == 503, healths[-1].text
        survivors = len(pids) > 1
        assert healths[-1].json()["status"] == ("degraded" if survivors else "engine stopped")
        assert set(ends) <= {"error", "length"}, ends
        if not survivors:
            assert set(ends) == {"error"}
        reply = httpx.post(
            f"{url}/v1/completions",
            json={"model": "toy", "prompt": "after", "max_tokens": 3, "ignore_eos": True},
            timeout=60,
        )
        if survivors:  # the core left serves it
            assert reply.status_code == 200, reply.text
            assert reply.json()["usage"]["completion_tokens"] == 3
        else:
            assert reply.status_code == 503  # refused, not queued on a dead core
        process.send_signal(signal.SIGTERM)
        assert process.wait(60) == 0
    deadline = time.monotonic() + 30
    while left := [pid for pid in everything if process_exists(pid)]:
        assert time.monotonic() < deadline, f"processes outlived the server: {left}"
        time.sleep(0.05)
    assert set(glob.glob("/dev/shm/vllm-rlt-*")) <= pools_before, "a KV pool was left behind"
