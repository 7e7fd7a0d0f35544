"""Serving benchmark: streaming completions against a running server over loopback.

Reports request throughput, output tokens/s, and the mean, p50 and p99 of time to first
token (TTFT), time per output token after the first (TPOT) and inter-token latency (ITL).

    vllm-rlt serve &                                       # serves the built-in ouro-tasks
    vllm-rlt bench serve --num-requests 64                 # asks the server for its model
    vllm-rlt bench serve --request-rate 20 --poisson --output serve.json

A progress bar of completed requests goes to stderr; the JSON report goes to stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import random
import statistics
import sys
import time
from typing import Any

import httpx
from tqdm import tqdm

from vllm_rlt.bench.report import emit_report
from vllm_rlt.entrypoints.parser import CLIParser


class ServerUnusable(Exception):
    """The server could not be asked for its model; the message says why, in one line."""


def one_line(text: str) -> str:
    return " ".join(str(text).split())


def served_model(url: str, api_key: str | None, timeout: float = 10.0) -> str:
    """The first model id the server lists at GET /v1/models."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        reply = httpx.get(f"{url}/v1/models", headers=headers, timeout=timeout)
    except httpx.TimeoutException:
        raise ServerUnusable(f"no answer within {timeout:g} s") from None
    except (httpx.HTTPError, httpx.InvalidURL) as exc:
        raise ServerUnusable(one_line(str(exc)) or type(exc).__name__) from None
    try:
        body = reply.json()
    except ValueError:
        body = None
    if reply.status_code != 200:
        message = body.get("error", {}).get("message") if isinstance(body, dict) else None
        problem = message or reply.text[:200] or reply.reason_phrase
        raise ServerUnusable(f"HTTP {reply.status_code}: {one_line(problem)}")
    try:
        return str(body["data"][0]["id"])
    except (TypeError, KeyError, IndexError):
        raise ServerUnusable("the answer lists no model") from None


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


async def one_request(http: httpx.AsyncClient, url: str, body: dict[str, Any]) -> dict[str, Any]:
    """Stream one completion; token arrival times come from the per-token exit depths."""
    start = time.perf_counter()
    arrivals: list[float] = []
    error = None
    try:
        async with http.stream("POST", f"{url}/v1/completions", json=body) as reply:
            if reply.status_code != 200:
                error = f"HTTP {reply.status_code}: {(await reply.aread())[:200]!r}"
            else:
                async for line in reply.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    event = json.loads(line[len("data: ") :])
                    now = time.perf_counter()
                    for choice in event.get("choices", []):
                        arrivals.extend([now] * len(choice.get("exit_depths", [])))
    except httpx.HTTPError as exc:  # the connection failed or broke off: a failed request
        error = f"{type(exc).__name__}: {one_line(str(exc))}"[:200]
    end = time.perf_counter()
    return {"start": start, "end": end, "arrivals": arrivals, "error": error}


async def run(args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed)
    lengths = [
        rng.randint(args.prompt_len_min, args.prompt_len)
        if args.prompt_len_min
        else args.prompt_len
        for _ in range(args.num_requests)
    ]
    bodies = [
        {
            "model": args.model,
            "prompt": [rng.randrange(3, args.max_token_id) for _ in range(length)],
            "max_tokens": args.output_len,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
            "return_exit_depths": True,
        }
        for length in lengths
    ]
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    progress = tqdm(total=args.num_requests, desc="requests", unit="req", file=sys.stderr)
    async with httpx.AsyncClient(timeout=None, headers=headers, limits=limits) as http:
        tasks = []
        began = time.perf_counter()
        for body in bodies:
            task = asyncio.ensure_future(one_request(http, args.url, body))
            task.add_done_callback(lambda _: progress.update(1))
            tasks.append(task)
            if args.request_rate != float("inf"):
                await asyncio.sleep(
                    rng.expovariate(args.request_rate) if args.poisson else 1 / args.request_rate
                )
        results = await asyncio.gather(*tasks)
        wall = time.perf_counter() - began
    progress.close()
    ok = [r for r in results if r["error"] is None and r["arrivals"]]
    ttft = [r["arrivals"][0] - r["start"] for r in ok]
    tpot = [
        (r["end"] - r["arrivals"][0]) / (len(r["arrivals"]) - 1)
        for r in ok
        if len(r["arrivals"]) > 1
    ]
    itl = [b - a for r in ok for a, b in itertools.pairwise(r["arrivals"]) if b > a]
    tokens = sum(len(r["arrivals"]) for r in ok)

    def stats(values: list[float]) -> dict[str, float | None]:
        return {
            "mean": statistics.fmean(values) if values else None,
            "p50": percentile(values, 50),
            "p99": percentile(values, 99),
        }

    return {
        "benchmark": "serve",
        "url": args.url,
        "model": args.model,
        "workload": {
            "num_requests": args.num_requests,
            "prompt_len": args.prompt_len,
            "prompt_len_min": args.prompt_len_min,
            "output_len": args.output_len,
            "request_rate": None if args.request_rate == float("inf") else args.request_rate,
            "arrivals": "poisson" if args.poisson else "fixed",
        },
        "completed": len(ok),
        "failed": [r["error"] for r in results if r["error"] is not None][:5],
        "wall_s": wall,
        "request_throughput_per_s": len(ok) / wall,
        "output_tokens_per_s": tokens / wall,
        "ttft_s": stats(ttft),
        "tpot_s": stats(tpot),
        "itl_s": stats(itl),
    }


def main(argv: list[str] | None = None) -> int:
    parser = CLIParser(prog="vllm-rlt bench serve", description=__doc__)
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="the server's base URL")
    parser.add_argument(
        "--model",
        default=None,
        help="model name to request (default: ask the server: the first id of GET /v1/models)",
    )
    parser.add_argument(
        "--api-key", default=None, help="sent as 'Authorization: Bearer KEY' (default: none)"
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
    parser.add_argument("--seed", type=int, default=0, help="seed of prompts and gaps")
    parser.add_argument(
        "--output", default=None, help="also write the JSON report here (default: stdout only)"
    )
    args = parser.parse_args(argv)
    if args.num_requests < 1 or args.prompt_len < 1 or args.output_len < 1:
        parser.error("--num-requests, --prompt-len and --output-len must be >= 1")
    if args.prompt_len_min > args.prompt_len:
        parser.error(
            f"--prompt-len-min ({args.prompt_len_min}) must be <= --prompt-len ({args.prompt_len})"
        )
    if args.max_token_id <= 3:
        parser.error(f"--max-token-id must be > 3, got {args.max_token_id}")
    if not args.request_rate > 0:
        parser.error(f"--request-rate must be > 0, got {args.request_rate}")
    args.url = args.url.rstrip("/")
    if args.model is None:
        try:
            args.model = served_model(args.url, args.api_key)
        except ServerUnusable as exc:
            parser.error(f"cannot ask {args.url}/v1/models for the model to use: {exc}")
    report = asyncio.run(run(args))
    emit_report(report, args.output)
    return 0 if report["completed"] else 1


if __name__ == "__main__":
    sys.exit(main())
