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
import importlib.metadata
import itertools
import platform
import random
import shlex
import statistics
import sys
import time
from functools import partial
from typing import Any

import orjson
from tqdm import tqdm

import vllm_rlt
from vllm_rlt import SamplingParams
from vllm_rlt.bench.device_figures import environment as device_environment
from vllm_rlt.bench.report import emit_report, percentile
from vllm_rlt.bench.serve_client import (
    BenchFailed,
    Outcome,
    ServerUnusable,
    auth,
    require_aiohttp,
    run_load,
    served_model,
    summary,
)
from vllm_rlt.bench.serve_launch import HOST, launched, server_flags_parser
from vllm_rlt.cli_parser import CLIParser
from vllm_rlt.entrypoints.args import engine_args_from, engine_config_or_exit

DEFAULT_URL = "http://127.0.0.1:8000"
ERRORS_SHOWN = 5
SLO_NAMES = ("ttft", "tpot", "e2el")


# ------------------------------------------------------------------------- the offline run
def run_offline(
    flags: argparse.Namespace, prompts: list[list[int]], output_len: int, warmup: int
) -> dict[str, Any]:
    """The offline engine built from the server's flags, on the same prompts, all at once,
    after `warmup` of them untimed."""
    from vllm_rlt.engine.llm import LLM

    llm = LLM.from_engine_config(engine_args_from(flags).create_engine_config())
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
        "aiohttp": importlib.metadata.version("aiohttp"),
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
    flags, _ = server_flags_parser().parse_known_args(server_flags)
    if flags.model is not None and flags.model != model:
        parser.error(f"the model is --launch's ({model}), not --model {flags.model} after --")
    flags.model = model
    if flags.host != HOST or flags.port != 8000:
        parser.error("--host and --port of the launched server are chosen by the bench")
    engine_config_or_exit(parser, flags)
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
    require_aiohttp(parser)
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
