"""The throughput benchmark's flags, and the command line that reruns a report's run."""

from __future__ import annotations

import argparse

from vllm_rlt.bench.shapes import SHAPES
from vllm_rlt.config import KV_CACHE_DTYPES, KV_LAYOUTS, QUANTIZATIONS
from vllm_rlt.entrypoints.args import add_speculation_args


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--shape", choices=list(SHAPES), default="toy", help="model shape, random weights"
    )
    parser.add_argument(
        "--device", default=None, help="cpu or cuda[:N] (default: cuda when available, else cpu)"
    )
    parser.add_argument("--dtype", default="auto", help="auto: bfloat16 on CUDA, float32 on CPU")
    parser.add_argument(
        "--attention-backend", default="auto", help="auto picks the best available on the device"
    )
    parser.add_argument(
        "--kv-layout", default="last_exited", choices=list(KV_LAYOUTS), help="KV cache layout"
    )
    parser.add_argument(
        "--mode", default="refill", choices=["refill", "no_refill"], help="scheduling mode"
    )
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    parser.add_argument(
        "--quantization",
        choices=QUANTIZATIONS,
        default=None,
        help="fp8: the engine's layer projections in float8 with a scale per output channel "
        "(the naive baseline keeps --dtype) (default: none)",
    )
    parser.add_argument(
        "--kv-cache-dtype",
        choices=KV_CACHE_DTYPES,
        default="auto",
        help="the engine's K/V storage: auto (the model's dtype), fp8 = fp8_e4m3, fp8_e5m2",
    )
    parser.add_argument(
        "--enforce-eager", action="store_true", help="no CUDA graphs (CPU never uses them)"
    )
    parser.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="plan the next pass while the device runs the current one; refill mode only "
        "(default: on)",
    )
    parser.add_argument("--prompt-len", type=int, default=64, help="prompt tokens per request")
    parser.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        help="each request's max_tokens when larger than --output-len: requests still end "
        "after --output-len tokens, as at an EOS, but ask for this many (default: "
        "--output-len)",
    )
    parser.add_argument(
        "--shared-prefix-len",
        type=int,
        default=0,
        help="tokens every prompt starts with (the same for all), before its own --prompt-len "
        "ones; with prefix caching the warm-up run leaves them cached for the timed runs",
    )
    parser.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="share the K/V of full prompt blocks between requests",
    )
    parser.add_argument("--output-len", type=int, default=32, help="output tokens per request")
    parser.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="the engine's runs sample at this temperature, seeded with --seed (0: greedy; "
        "the baseline stays greedy)",
    )
    parser.add_argument(
        "--top-p",
        type=float,
        default=1.0,
        help="nucleus mass when sampling (below 1, a pass finds where each row's "
        "filters cut: by search on the GPU, by sort on the CPU)",
    )
    parser.add_argument("--top-k", type=int, default=0, help="top-k when sampling (0: off)")
    add_speculation_args(parser, replay=True)
    parser.add_argument(
        "--concurrency",
        type=int,
        nargs="+",
        default=[1, 8, 64],
        help="requests run together; one result per value",
    )
    depth = parser.add_mutually_exclusive_group()
    depth.add_argument(
        "--depth",
        type=int,
        default=None,
        help="loops per token, fixed (default: all of the model's loops)",
    )
    depth.add_argument(
        "--depth-trace-mean",
        type=float,
        default=None,
        help="instead of a fixed depth, replay random per-token depths with this mean "
        "(default: off, fixed depth)",
    )
    parser.add_argument(
        "--exit-sync-passes",
        type=int,
        default=None,
        help="Huginn shapes: a token that decides to exit may wait up to N-1 passes for "
        "others, so the coda and LM head run once for all of them; 1: exit at once (default: "
        "the engine's, 2 for Huginn shapes, 1 for Ouro's)",
    )
    parser.add_argument(
        "--waves",
        type=int,
        default=1,
        help="requests per slot: each run sends concurrency x this many requests through "
        "concurrency slots, so above 1 a finished request's slot is refilled from the queue "
        "as in steady serving, not left idle while the batch's last requests finish (the "
        "baseline runs one static batch of concurrency)",
    )
    parser.add_argument("--warmup", type=int, default=1, help="untimed runs before the timed ones")
    parser.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="timed runs; the fastest is reported, with every run's decode tok/s and their median",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of weights, prompts and traces")
    parser.add_argument("--no-baseline", action="store_true", help="skip the naive baseline")
    parser.add_argument(
        "--output", default=None, help="also write the JSON report here (default: stdout only)"
    )


def command_line(args: argparse.Namespace) -> str:
    """The flags that shaped the run (not where its JSON went), as one command to rerun."""
    parts = ["vllm-rlt bench throughput"]
    for name, value in sorted(vars(args).items()):
        if name in ("async_scheduling", "enable_prefix_caching") and value is False:
            parts.append("--no-" + name.replace("_", "-"))  # on by default: say it was off
            continue
        if name == "output" or value is None or value is False:
            continue
        flag = "--" + name.replace("_", "-")
        if value is True:
            parts.append(flag)
        elif isinstance(value, list):
            parts.append(f"{flag} {' '.join(map(str, value))}")
        else:
            parts.append(f"{flag} {value}")
    return " ".join(parts)
