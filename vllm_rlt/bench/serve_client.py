"""The serving benchmark's load generator: streaming clients, in one process or several
started together, that time every token of every request (see bench/serve.py)."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import queue
import statistics
import sys
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeVar

import orjson
from tqdm import tqdm

from vllm_rlt.bench.report import percentile

try:  # the serve extra's; without it, `bench serve --help` still answers
    import aiohttp

    AIOHTTP_MISSING = ""
except ModuleNotFoundError:
    AIOHTTP_MISSING = (
        'needs aiohttp, which is not installed: pip install "vllm-rlt[serve]" (from a clone: '
        'pip install -e ".[serve]")'
    )


def require_aiohttp(parser) -> None:
    """Stop with one line, after --help has answered, where aiohttp is missing: every
    served measurement (bench serve, bench sweep --launch) needs it."""
    if AIOHTTP_MISSING:
        parser.error(AIOHTTP_MISSING)


CLIENT_START_TIMEOUT_S = 300.0  # each client process imports the package before it starts
JSON_HEADERS = {"Content-Type": "application/json"}

T = TypeVar("T")


class ServerUnusable(Exception):
    """The server could not be asked for its model; the message says why, in one line."""


class BenchFailed(Exception):
    """The run could not go on (the launched server or a client process died)."""

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code


@dataclass(slots=True)
class Outcome:
    """One request, in seconds since its client's start: when it was sent, when each read
    that brought tokens returned and how many it brought, when the stream ended."""

    start: float
    end: float
    times: list[float]
    counts: list[int]
    error: str | None

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.times)

    @property
    def tokens(self) -> int:
        return sum(self.counts)

    @property
    def ttft(self) -> float:
        return self.times[0] - self.start

    @property
    def tpot(self) -> float | None:
        return (self.end - self.times[0]) / (self.tokens - 1) if self.tokens > 1 else None


def one_line(text: str) -> str:
    return " ".join(str(text).split())


def describe(exc: BaseException) -> str:
    """A client-side failure in one line; a refused connection says so in words."""
    if isinstance(exc, aiohttp.ClientConnectorError) and exc.os_error.errno:
        return f"cannot connect to {exc.host}:{exc.port}: {os.strerror(exc.os_error.errno)}"
    if isinstance(exc, asyncio.TimeoutError):
        return "timed out"
    return one_line(f"{type(exc).__name__}: {exc}")


def run_async(main: Coroutine[Any, Any, T]) -> T:
    """Run a coroutine on uvloop when it is installed: its event loop costs the client less
    per event, which raises the ceiling of what one client process can measure."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)


def auth(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def served_model(url: str, api_key: str | None, timeout: float = 10.0) -> str:
    """The first model id the server lists at GET /v1/models."""
    return run_async(_served_model(url, api_key, timeout))


async def _served_model(url: str, api_key: str | None, timeout: float) -> str:
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as http:
            async with http.get(f"{url}/v1/models", headers=auth(api_key)) as reply:
                status, reason, raw = reply.status, reply.reason, await reply.read()
    except asyncio.TimeoutError:
        raise ServerUnusable(f"no answer within {timeout:g} s") from None
    except (aiohttp.ClientError, OSError, ValueError) as exc:
        raise ServerUnusable(describe(exc)) from None
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        body = None
    if status != 200:
        error = body.get("error") if isinstance(body, dict) else None
        message = error.get("message") if isinstance(error, dict) else None
        problem = message or raw[:200].decode(errors="replace") or reason or ""
        raise ServerUnusable(f"HTTP {status}: {one_line(problem)}")
    try:
        return str(body["data"][0]["id"])  # type: ignore[index]
    except (TypeError, KeyError, IndexError):
        raise ServerUnusable("the answer lists no model") from None


def summary(values: list[float]) -> dict[str, float | None]:
    return {
        "mean": statistics.fmean(values) if values else None,
        "p50": percentile(values, 50),
        "p90": percentile(values, 90),
        "p99": percentile(values, 99),
    }


# ------------------------------------------------------------------------------ the client
class StreamFailed(Exception):
    """The server sent an error event after the stream began."""


def tokens_in(lines: list[bytes]) -> int:
    """Tokens that complete SSE lines carry: the exit depths of each `data: {...}` event."""
    tokens = 0
    for line in lines:
        if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
            continue
        event = orjson.loads(line[6:])
        if "error" in event:
            raise StreamFailed(f"error event: {one_line(orjson.dumps(event['error']).decode())}")
        tokens += sum(len(choice.get("exit_depths") or ()) for choice in event["choices"])
    return tokens


async def one_request(http: aiohttp.ClientSession, url: str, body: bytes, t0: float) -> Outcome:
    """Stream one completion. Whatever one read returns is taken whole and split into lines
    here (far cheaper than reading line by line); its events arrived together, at one time."""
    start = time.perf_counter()
    times: list[float] = []
    counts: list[int] = []
    error = None
    try:
        async with http.post(f"{url}/v1/completions", data=body, headers=JSON_HEADERS) as reply:
            if reply.status != 200:
                text = (await reply.read())[:200].decode(errors="replace")
                error = f"HTTP {reply.status}: {one_line(text)}"
            else:
                pending = b""
                async for data in reply.content.iter_any():
                    now = time.perf_counter()
                    *lines, pending = (pending + data).split(b"\n")
                    tokens = tokens_in(lines)
                    if tokens:
                        times.append(now - t0)
                        counts.append(tokens)
    except StreamFailed as exc:
        error = str(exc)[:200]
    except (aiohttp.ClientError, OSError, ValueError, KeyError, asyncio.TimeoutError) as exc:
        error = describe(exc)[:200]  # the connection failed or broke off, or a bad event
    return Outcome(start - t0, time.perf_counter() - t0, times, counts, error)


async def drive(
    url: str,
    headers: dict[str, str],
    jobs: list[tuple[float, bytes]],
    max_concurrency: int | None,
    on_done: Callable[[], None],
    ready: Callable[[], None],
) -> list[Outcome]:
    """Send each (offset, body) at its offset after the start, at most max_concurrency at a
    time; `ready` returns when every client may start."""
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=None)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout, headers=headers) as http:
        limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None

        async def send(body: bytes) -> Outcome:
            if limit is None:
                return await one_request(http, url, body, t0)
            async with limit:
                return await one_request(http, url, body, t0)

        ready()
        t0 = time.perf_counter()
        tasks = []
        for offset, body in jobs:
            delay = t0 + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            task = asyncio.create_task(send(body))
            task.add_done_callback(lambda _: on_done())
            tasks.append(task)
        return list(await asyncio.gather(*tasks))


def client_process(
    url: str,
    headers: dict[str, str],
    jobs: list[tuple[float, bytes]],
    max_concurrency: int | None,
    barrier: Any,
    done: Any,
    results: Any,
) -> None:
    """One of --num-clients processes: its share of the requests, started with the others."""

    def count() -> None:
        with done.get_lock():
            done.value += 1

    results.put(run_async(drive(url, headers, jobs, max_concurrency, count, barrier.wait)))


def run_clients(
    url: str,
    headers: dict[str, str],
    shares: list[list[tuple[float, bytes]]],
    limits: list[int | None],
    progress: tqdm,
) -> list[Outcome]:
    """Each share in its own process; they wait for one another so that they start together."""
    context = multiprocessing.get_context("spawn")
    done = context.Value("q", 0)
    barrier = context.Barrier(len(shares), timeout=CLIENT_START_TIMEOUT_S)
    results = context.Queue()
    processes = [
        context.Process(
            target=client_process,
            args=(url, headers, share, limit, barrier, done, results),
            daemon=True,
        )
        for share, limit in zip(shares, limits, strict=True)
    ]
    for process in processes:
        process.start()
    merged: list[Outcome] = []
    received = 0
    try:
        while received < len(processes):
            try:
                merged.extend(results.get(timeout=0.1))
                received += 1
            except queue.Empty:
                failed = [p.exitcode for p in processes if p.exitcode not in (None, 0)]
                if failed:
                    barrier.abort()
                    raise BenchFailed(f"a client process exited with code {failed[0]}") from None
            if done.value > progress.n:
                progress.update(done.value - progress.n)
    finally:
        for process in processes:
            process.join(timeout=10)
            if process.is_alive():
                process.terminate()
                process.join()
    return merged


def run_load(
    url: str,
    headers: dict[str, str],
    jobs: list[tuple[float, bytes]],
    max_concurrency: int | None,
    num_clients: int,
) -> tuple[list[Outcome], float]:
    """(every request's outcome, seconds from the common start to the last completion)."""
    with tqdm(total=len(jobs), desc="requests", unit="req", file=sys.stderr) as progress:
        if num_clients == 1:
            outcomes = run_async(
                drive(
                    url, headers, jobs, max_concurrency, partial(progress.update, 1), lambda: None
                )
            )
        else:
            # Request i goes to client i % N at its own offset: together they keep the rate.
            shares = [jobs[k::num_clients] for k in range(num_clients)]
            limits: list[int | None] = [
                None
                if max_concurrency is None
                else max_concurrency // num_clients + (k < max_concurrency % num_clients)
                for k in range(num_clients)
            ]
            outcomes = run_clients(url, headers, shares, limits, progress)
    return outcomes, max(outcome.end for outcome in outcomes)
