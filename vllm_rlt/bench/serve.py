"""Serving benchmark: a load generator for the OpenAI-compatible server that is built never to be
the bottleneck, and, in the same run, the offline engine on the same prompts.

Streams completions of random token-id prompts (temperature 0, EOS ignored, exit depths
returned so that every token is counted, however many one event carries) and reports request
and output-token throughput, the mean, p50, p90 and p99 of time to first token (TTFT), time
per output token after the first (TPOT), inter-token latency (ITL) and end-to-end latency, and
with --goodput the requests per second that met every latency objective.

    vllm-rlt serve &                                       # serves the built-in ouro-tasks
    vllm-rlt bench serve --num-requests 64                 # asks the server for its model
    vllm-rlt bench serve --request-rate 20 --poisson --goodput ttft:500 tpot:50
    vllm-rlt bench serve --launch toy --compare-offline -- --max-num-seqs 64

--launch MODEL starts `vllm-rlt serve MODEL` on a free loopback port with the flags given
after `--` (its output goes to stderr), waits until /health answers, runs the load and stops the
server. --compare-offline then builds the offline engine from the same flags, once the server's
memory is free, and generates the same prompts: the offline engine admits every request at
once, as the server does under the default infinite --request-rate, so only then do the
"ratio" figures compare like with like. Both sides first run --warmup-requests untimed
(default: the whole workload once), so that neither pays in the timed run for first-use work
such as capturing the CUDA graph of a batch size.

--num-clients N splits the requests over N client processes (each keeps the arrival times of
its share, so the overall rate is the one asked for) that start together; their results are
merged before the statistics. --max-concurrency caps the requests in flight over all of them.

The generator's own ceiling: --stub starts, instead of a server, a stub that does no inference
and streams tokens as fast as it can (also `python -m vllm_rlt.bench.stub_server --port P`).

    vllm-rlt bench serve --stub --num-requests 256 --output-len 32
    vllm-rlt bench serve --stub --num-requests 256 --output-len 32 --num-clients 4

The output tokens/s reached against the stub is the most this machine can measure (the stub
shares its cores); a server measured near that figure is limited by the client: add clients.

A progress bar of completed requests goes to stderr; the JSON report goes to stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import multiprocessing
import os
import platform
import queue
import random
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Coroutine, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from typing import IO, Any, TypeVar

import aiohttp
import orjson
from tqdm import tqdm

import vllm_rlt
from vllm_rlt import SamplingParams
from vllm_rlt.bench.report import emit_report, percentile
from vllm_rlt.bench.throughput import environment as device_environment
from vllm_rlt.cli_parser import CLIParser
from vllm_rlt.entrypoints.args import add_engine_args, engine_args_from
from vllm_rlt.entrypoints.cli import add_server_args

DEFAULT_URL = "http://127.0.0.1:8000"
HOST = "127.0.0.1"
READY_TIMEOUT_S = 600.0  # loading a large checkpoint and building its KV pool takes minutes
STOP_TIMEOUT_S = 60.0
CLIENT_START_TIMEOUT_S = 300.0  # each client process imports the package before it starts
ERRORS_SHOWN = 5
SLO_NAMES = ("ttft", "tpot", "e2el")
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


# --------------------------------------------------------------------- the launched server
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


# ------------------------------------------------------------------------- the offline run
def run_offline(
    flags: argparse.Namespace, prompts: list[list[int]], output_len: int, warmup: int
) -> dict[str, Any]:
    """The offline engine built from the server's flags, on the same prompts, all at once,
    after `warmup` of them untimed."""
    from vllm_rlt.engine.llm import LLM

    llm = LLM(**engine_args_from(flags).llm_kwargs())
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    if warmup:
        warm = [{"prompt_token_ids": ids} for ids in prompts[:warmup]]
        llm.generate(warm, params, use_tqdm=False)
    bar = partial(tqdm, desc="offline", unit="req", file=sys.stderr)
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompts], params, use_tqdm=bar)
    wall = time.perf_counter() - start
    tokens = sum(len(output.outputs[0].token_ids) for output in outputs)
    ttft = [
        output.metrics.time_to_first_token
        for output in outputs
        if output.metrics.time_to_first_token is not None
    ]
    return {
        "wall_s": wall,
        "request_throughput_per_s": len(outputs) / wall,
        "output_tokens_per_s": tokens / wall,
        "total_output_tokens": tokens,
        "ttft_s": {
            "mean": statistics.fmean(ttft) if ttft else None,
            "p50": percentile(ttft, 50),
        },
    }


def environment(device: str | None) -> dict[str, Any]:
    """Versions here; with a launched server also torch and its device (after it exited, so
    that asking for the GPU's name takes no memory from the server)."""
    info: dict[str, Any] = {
        "python": platform.python_version(),
        "vllm_rlt": vllm_rlt.__version__,
        "aiohttp": aiohttp.__version__,
    }
    if device is not None:
        from vllm_rlt.models.load import resolve_device

        info.update(device_environment(resolve_device(device)))
    return info


# ---------------------------------------------------------------------------- the report
def latency_report(outcomes: list[Outcome], wall: float, slos: dict[str, float]) -> dict:
    ok = [o for o in outcomes if o.ok]
    failed = [o.error or "the stream ended without a token" for o in outcomes if not o.ok]
    ttft = [o.ttft for o in ok]
    tpot = [t for o in ok if (t := o.tpot) is not None]
    itl = [b - a for o in ok for a, b in itertools.pairwise(o.times)]
    e2el = [o.end - o.start for o in ok]
    tokens = sum(o.tokens for o in ok)
    report: dict[str, Any] = {
        "completed": len(ok),
        "num_failed": len(failed),
        "failed": failed[:ERRORS_SHOWN],
        "wall_s": wall,
        "request_throughput_per_s": len(ok) / wall,
        "output_tokens_per_s": tokens / wall,
        "total_output_tokens": tokens,
        "ttft_s": summary(ttft),
        "tpot_s": summary(tpot),
        "itl_s": summary(itl),
        "e2el_s": summary(e2el),
    }
    if slos:
        good = sum(
            all(
                {"ttft": o.ttft, "tpot": o.tpot or 0.0, "e2el": o.end - o.start}[name] * 1e3 <= ms
                for name, ms in slos.items()
            )
            for o in ok
        )
        report["goodput"] = {
            "slo_ms": slos,
            "good_requests": good,
            "requests_per_s": good / wall,
        }
    return report


# ------------------------------------------------------------------------- command line
def slo(text: str) -> tuple[str, float]:
    """One --goodput objective, NAME:MS."""
    name, _, value = text.partition(":")
    try:
        ms = float(value)
    except ValueError:
        ms = float("nan")
    if name not in SLO_NAMES or not 0 <= ms < float("inf"):
        raise argparse.ArgumentTypeError(
            f"expected NAME:MS with NAME one of {', '.join(SLO_NAMES)} and MS >= 0, got {text!r}"
        )
    return name, ms


def build_parser() -> CLIParser:
    parser = CLIParser(
        prog="vllm-rlt bench serve",
        usage="%(prog)s [options] [-- SERVER_FLAGS ...]",
        description=__doc__,
    )
    target = parser.add_mutually_exclusive_group()
    target.add_argument(
        "--url", default=None, help=f"the server's base URL (default: {DEFAULT_URL})"
    )
    target.add_argument(
        "--launch",
        metavar="MODEL",
        default=None,
        help="start `vllm-rlt serve MODEL` with the flags after `--`, run the load, stop it "
        "(default: use the server at --url)",
    )
    target.add_argument(
        "--stub",
        action="store_true",
        help="start the stub server (no inference) instead: the generator's own ceiling",
    )
    parser.add_argument(
        "--compare-offline",
        action="store_true",
        help="with --launch: then run the offline engine with the same flags on the same prompts",
    )
    parser.add_argument(
        "--model",
        default=None,
        help="model name to request (default: ask the server: the first id of GET /v1/models)",
    )
    parser.add_argument(
        "--api-key",
        default=None,
        help="sent as 'Authorization: Bearer KEY' (default: none, or the launched server's)",
    )
    parser.add_argument("--num-requests", type=int, default=64, help="requests to send in all")
    parser.add_argument(
        "--prompt-len",
        type=int,
        default=64,
        help="prompt tokens per request (the upper bound with --prompt-len-min)",
    )
    parser.add_argument(
        "--prompt-len-min",
        type=int,
        default=0,
        help="if > 0, draw prompt lengths uniformly from [this, --prompt-len]",
    )
    parser.add_argument(
        "--max-token-id", type=int, default=250, help="random prompt ids are in [3, this)"
    )
    parser.add_argument("--output-len", type=int, default=32, help="output tokens per request")
    parser.add_argument(
        "--request-rate",
        type=float,
        default=float("inf"),
        help="requests sent per second; inf sends them all at once",
    )
    parser.add_argument(
        "--poisson", action="store_true", help="exponential gaps between requests (else fixed)"
    )
    parser.add_argument(
        "--warmup-requests",
        type=int,
        default=None,
        help="untimed requests sent first, all at once, on both sides (default: every request "
        "of the workload once; 0: none)",
    )
    parser.add_argument(
        "--max-concurrency",
        type=int,
        default=None,
        help="requests in flight at most; the others wait for one to finish (default: no limit)",
    )
    parser.add_argument(
        "--num-clients",
        type=int,
        default=1,
        help="client processes that share the requests, for loads one process cannot send",
    )
    parser.add_argument(
        "--goodput",
        type=slo,
        nargs="+",
        default=None,
        metavar="NAME:MS",
        help="latency objectives in ms, e.g. ttft:500 tpot:50 (names: ttft, tpot, e2el); "
        "reports the requests per second that met all of them (default: none)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of prompts and gaps")
    parser.add_argument(
        "--output", default=None, help="also write the JSON report here (default: stdout only)"
    )
    return parser


def check(parser: CLIParser, args: argparse.Namespace, server_flags: list[str]) -> None:
    if args.num_requests < 1 or args.prompt_len < 1 or args.output_len < 1:
        parser.error("--num-requests, --prompt-len and --output-len must be >= 1")
    if args.warmup_requests is not None and not 0 <= args.warmup_requests <= args.num_requests:
        parser.error(
            f"--warmup-requests must be in [0, --num-requests], got {args.warmup_requests}"
        )
    if args.prompt_len_min > args.prompt_len:
        parser.error(
            f"--prompt-len-min ({args.prompt_len_min}) must be <= --prompt-len ({args.prompt_len})"
        )
    if args.max_token_id <= 3:
        parser.error(f"--max-token-id must be > 3, got {args.max_token_id}")
    if not args.request_rate > 0:
        parser.error(f"--request-rate must be > 0, got {args.request_rate}")
    if not 1 <= args.num_clients <= args.num_requests:
        parser.error(f"--num-clients must be in [1, --num-requests], got {args.num_clients}")
    if args.max_concurrency is not None and args.max_concurrency < args.num_clients:
        parser.error(
            f"--max-concurrency must be >= --num-clients ({args.num_clients}), "
            f"got {args.max_concurrency}"
        )
    if args.compare_offline and args.launch is None:
        parser.error("--compare-offline needs --launch MODEL (the engine flags come after --)")
    if server_flags and args.launch is None:
        parser.error(
            f"the arguments after -- are server flags and need --launch: {' '.join(server_flags)}"
        )
    if args.goodput:
        names = [name for name, _ in args.goodput]
        if len(set(names)) < len(names):
            parser.error(f"--goodput names each objective once, got {' '.join(names)}")


def engine_flags(parser: CLIParser, model: str, server_flags: list[str]) -> argparse.Namespace:
    """The launched server's flags as the engine and the bench read them; flags the server
    alone knows are left to it (it rejects bad ones when it starts)."""
    from vllm_rlt.models.load import check_model_source

    flags, _ = server_flags_parser().parse_known_args(server_flags)
    if flags.model is not None and flags.model != model:
        parser.error(f"the model is --launch's ({model}), not --model {flags.model} after --")
    flags.model = model
    if flags.host != HOST or flags.port != 8000:
        parser.error("--host and --port of the launched server are chosen by the bench")
    try:
        engine_args_from(flags)
        check_model_source(model)
    except (ValueError, OSError) as exc:
        parser.error(str(exc))
    return flags


def workload(args: argparse.Namespace) -> tuple[list[list[int]], list[float]]:
    """(prompts, send offsets in seconds); one seed makes both."""
    rng = random.Random(args.seed)
    lengths = [
        rng.randint(args.prompt_len_min, args.prompt_len)
        if args.prompt_len_min
        else args.prompt_len
        for _ in range(args.num_requests)
    ]
    prompts = [[rng.randrange(3, args.max_token_id) for _ in range(n)] for n in lengths]
    if args.request_rate == float("inf"):
        return prompts, [0.0] * args.num_requests
    gaps = [
        rng.expovariate(args.request_rate) if args.poisson else 1 / args.request_rate
        for _ in range(args.num_requests - 1)
    ]
    return prompts, [0.0, *itertools.accumulate(gaps)]


def measure(
    parser: CLIParser,
    args: argparse.Namespace,
    url: str,
    prompts: list[list[int]],
    offsets: list[float],
) -> dict[str, Any]:
    """Warm-up, then the timed load against the server at url."""
    if args.model is None:
        try:
            args.model = served_model(url, args.api_key)
        except ServerUnusable as exc:
            parser.error(f"cannot ask {url}/v1/models for the model to use: {exc}")
    bodies = [
        orjson.dumps(
            {
                "model": args.model,
                "prompt": prompt,
                "max_tokens": args.output_len,
                "temperature": 0.0,
                "ignore_eos": True,
                "stream": True,
                "return_exit_depths": True,
            }
        )
        for prompt in prompts
    ]
    headers = auth(args.api_key)
    warmup = len(bodies) if args.warmup_requests is None else args.warmup_requests
    if warmup:
        warm = [(0.0, body) for body in bodies[:warmup]]
        run_load(url, headers, warm, args.max_concurrency, args.num_clients)
    jobs = list(zip(offsets, bodies, strict=True))
    outcomes, wall = run_load(url, headers, jobs, args.max_concurrency, args.num_clients)
    report = latency_report(outcomes, wall, dict(args.goodput or ()))
    report["total_input_tokens"] = sum(len(prompt) for prompt in prompts)
    return report


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = shlex.join(["vllm-rlt", "bench", "serve", *argv])
    split = argv.index("--") if "--" in argv else len(argv)
    argv, server_flags = argv[:split], argv[split + 1 :]
    parser = build_parser()
    args = parser.parse_args(argv)
    check(parser, args, server_flags)
    flags = engine_flags(parser, args.launch, server_flags) if args.launch else None
    if flags is not None and args.api_key is None:
        args.api_key = flags.api_key  # the key the server will ask for (flag or environment)
    prompts, offsets = workload(args)
    launch: dict[str, Any] = {}
    try:
        if args.launch is not None:
            launch.update(model=args.launch, server_flags=server_flags)
            server = ["vllm_rlt.entrypoints.cli", "serve", args.launch]
            with launched(server, server_flags, launch) as url:
                result = measure(parser, args, url, prompts, offsets)
        elif args.stub:
            launch.update(stub=True)
            with launched(["vllm_rlt.bench.stub_server"], [], launch) as url:
                result = measure(parser, args, url, prompts, offsets)
        else:
            url = (args.url or DEFAULT_URL).rstrip("/")
            result = measure(parser, args, url, prompts, offsets)
    except BenchFailed as exc:
        print(f"{parser.prog}: error: {exc}", file=sys.stderr)
        return exc.exit_code
    report: dict[str, Any] = {
        "benchmark": "serve",
        "command": command,
        "environment": environment(flags.device if flags is not None else None),
        "url": url,
        "model": args.model,
        "launch": launch or None,
        "workload": {
            "num_requests": args.num_requests,
            "prompt_len": args.prompt_len,
            "prompt_len_min": args.prompt_len_min,
            "output_len": args.output_len,
            "request_rate": None if args.request_rate == float("inf") else args.request_rate,
            "arrivals": "poisson" if args.poisson else "fixed",
            "max_concurrency": args.max_concurrency,
            "num_clients": args.num_clients,
            "seed": args.seed,
        },
        **result,
    }
    if flags is not None and args.compare_offline:
        warmup = len(prompts) if args.warmup_requests is None else args.warmup_requests
        offline = run_offline(flags, prompts, args.output_len, warmup)
        report["offline"] = offline
        report["ratio"] = {
            "output_tokens_per_s": result["output_tokens_per_s"] / offline["output_tokens_per_s"],
            "ttft_p50": (
                result["ttft_s"]["p50"] / offline["ttft_s"]["p50"]
                if result["ttft_s"]["p50"] is not None and offline["ttft_s"]["p50"]
                else None
            ),
        }
    emit_report(report, args.output)
    return 0 if report["completed"] else 1


if __name__ == "__main__":
    sys.exit(main())
