"""Offline throughput benchmark: the engine against a naive eager baseline (the same weights
in dense eager PyTorch: a static batch, one contiguous K/V cache per loop and layer, every
loop for every token).

Every figure is measured in one process on one device, so ratios compare like with like.
Reports decode and end-to-end tokens/s, mean TTFT and TPOT, and on CUDA the peak memory
and the fraction of a memory-bandwidth roofline achieved.

    vllm-rlt bench throughput                              # toy shape, concurrency 1 8 64
    vllm-rlt bench throughput --shape ouro-1.4b --concurrency 1 32 --output run.json
    vllm-rlt bench throughput --depth-trace-mean 2.5 --no-baseline

A progress bar over the runs (warmup and repeats of engine and baseline, per concurrency)
goes to stderr; the JSON report goes to stdout.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import platform
import random
import statistics
import sys
import time
from typing import TYPE_CHECKING, Any

from tqdm import tqdm

from vllm_rlt.bench.report import check_minimums, percentile, run_and_emit
from vllm_rlt.bench.shapes import SHAPES
from vllm_rlt.cli_parser import CLIParser
from vllm_rlt.config import (
    KV_CACHE_DTYPES,
    KV_LAYOUTS,
    QUANTIZATIONS,
    CacheConfig,
    ExecutionConfig,
    ExitConfig,
    SchedulerConfig,
)
from vllm_rlt.entrypoints.args import add_speculation_args, speculative_config
from vllm_rlt.sampling_params import RequestOutputKind, SamplingParams

if TYPE_CHECKING:  # torch and the engine load when a run starts, not to parse flags
    import torch

    from vllm_rlt.engine.engine_core import EngineCore


MAX_WAVES = 1000  # a typo of a few digits must not build billions of prompts


def depth_distribution(mean: float, max_depth: int) -> list[float]:
    """The maximum-entropy distribution over depths 1..max_depth with the given mean."""
    if not 1.0 <= mean <= max_depth:
        raise ValueError(f"--depth-trace-mean must be in [1, {max_depth}], got {mean}")
    depths = range(1, max_depth + 1)

    def probs(tilt: float) -> list[float]:
        weights = [math.exp(tilt * d) for d in depths]
        total = sum(weights)
        return [w / total for w in weights]

    low, high = -50.0, 50.0
    for _ in range(200):
        mid = (low + high) / 2
        if sum(d * p for d, p in zip(depths, probs(mid), strict=True)) < mean:
            low = mid
        else:
            high = mid
    return probs((low + high) / 2)


def make_traces(
    ids: list[str], output_len: int, mean: float, loops: int, seed: int
) -> dict[str, tuple[int, ...]]:
    rng = random.Random(seed)
    weights = depth_distribution(mean, loops)
    depths = list(range(1, loops + 1))
    return {rid: (loops, *rng.choices(depths, weights, k=max(output_len - 1, 1))) for rid in ids}


def run_engine(
    engine: EngineCore,
    prompts: list[list[int]],
    params: SamplingParams,
    stop_after: int | None = None,
) -> dict:
    """Run one batch to completion, recording when each request got each token.
    `stop_after`: end each request after that many tokens, as EOS would, whatever its
    max_tokens (the client's cap, which full-lifetime reservation had to hold blocks for)."""
    import torch

    from vllm_rlt.engine.llm_engine import LLMEngine

    sync = torch.cuda.synchronize if engine.model.device.type == "cuda" else (lambda: None)
    frontend = LLMEngine(engine, None)  # as LLM runs it; outputs as deltas, nothing copied
    params = dataclasses.replace(params, output_kind=RequestOutputKind.DELTA)
    ids = [f"b{i}" for i in range(len(prompts))]
    sync()
    start = time.perf_counter()
    for rid, prompt in zip(ids, prompts, strict=True):
        frontend.add_request(rid, prompt, params)
    first: dict[str, float] = {}
    done: dict[str, float] = {}
    depths: dict[str, list[int]] = {rid: [] for rid in ids}  # every token's exit depth
    passes = max_running = 0
    while frontend.has_unfinished:
        max_running = max(max_running, len(engine.scheduler.running))
        for out in frontend.step():
            now = time.perf_counter()
            first.setdefault(out.request_id, now)
            got = depths[out.request_id]
            got += out.outputs[0].exit_depths if out.outputs else []
            if stop_after and not out.finished and len(got) >= stop_after:
                ended = frontend.abort_request(out.request_id)
                assert ended is not None and ended.finished
                got += ended.outputs[0].exit_depths if ended.outputs else []
                out = ended
            if out.finished:
                done[out.request_id] = now
        passes += 1
    end = time.perf_counter()
    # All at once: decode runs from the last first token on. Queued (the KV pool holds
    # fewer): later prefills interleave with decode, so the window starts at the first.
    queued = max_running < len(prompts)
    decode_start = min(first.values()) if queued else max(first.values())
    tokens = sum(len(d) for d in depths.values())
    decode_tokens = tokens - len(depths)
    decode_depths = [d for got in depths.values() for d in got[1:]]
    tpot = [
        (done[rid] - first[rid]) / (len(depths[rid]) - 1) for rid in ids if len(depths[rid]) > 1
    ]
    ttft = [first[rid] - start for rid in ids]
    return {
        "decode_tokens_per_s": decode_tokens / max(end - decode_start, 1e-9),
        "ttft_s_mean": statistics.fmean(ttft),
        "ttft_s_p50": percentile(ttft, 50),
        "ttft_s_p99": percentile(ttft, 99),
        "tpot_s_mean": statistics.fmean(tpot) if tpot else None,
        "tpot_s_p50": percentile(tpot, 50),
        "tpot_s_p99": percentile(tpot, 99),
        "end_to_end_tokens_per_s": tokens / (end - start),
        "mean_loops": statistics.fmean(decode_depths) if decode_depths else None,
        "passes": passes,
        "wall_s": end - start,
        "max_running": max_running,
        "decode_window": "first first token to end" if queued else "last first token to end",
    }


def max_tokens_of(args: argparse.Namespace) -> int:
    return args.max_tokens or args.output_len


def build_engine(
    model, args, concurrency: int, exit_config: ExitConfig, whole_pool: bool = True
) -> EngineCore:
    """`whole_pool`: KV blocks for every request at once; else the pool is sized from the
    device's free memory and the scheduler queues what does not fit."""
    from vllm_rlt.engine.builder import build_engine_core

    prompt_len = args.shared_prefix_len + args.prompt_len
    max_len = prompt_len + max_tokens_of(args)
    per_request = -(-max_len // args.block_size)
    if args.kv_layout == "shared_decode":  # one-plane blocks, every loop's while prefilling
        per_request += (model.config.num_loops - 1) * -(-prompt_len // args.block_size)
    blocks = concurrency * per_request + 8 if whole_pool else None
    return build_engine_core(
        model,
        None,
        CacheConfig(
            layout=args.kv_layout,
            block_size=args.block_size,
            kv_cache_dtype=args.kv_cache_dtype,
            num_blocks=blocks,
            enable_prefix_caching=args.enable_prefix_caching,
        ),
        SchedulerConfig(
            mode=args.mode,
            max_num_seqs=max(concurrency, 1),
            max_num_batched_tokens=max(concurrency * prompt_len, 2048),
            prefill_chunk_size=max(prompt_len, 1),
            max_prefill_batches_before_decode=max(concurrency, 1),
        ),
        exit_config,
        ExecutionConfig(cuda_graphs=not args.enforce_eager, async_scheduling=args.async_scheduling),
        args.attention_backend,
        speculative_config(args),
    )


def execution(engine: EngineCore) -> dict[str, Any]:
    """What the built engine actually runs with (CUDA graphs only exist on CUDA, async
    scheduling only in refill mode, "auto" resolves to one backend)."""
    return {
        "cuda_graphs": engine.runner.graphs is not None,
        "async_scheduling": engine.async_scheduling,
        "attention_backend": engine.attention_backend,
    }


def runs_per_concurrency(args: argparse.Namespace) -> int:
    """Timed and warmup runs of the engine, and of the baseline unless it is skipped."""
    return (args.warmup + args.repeats) * (1 if args.no_baseline else 2)


def bench_concurrency(
    model, args, concurrency: int, progress: tqdm, engine_model=None
) -> dict[str, Any]:
    """One concurrency's runs: the engine runs `engine_model` (the model, or its quantized
    copy under --quantization), the naive baseline the unquantized model."""
    import torch

    from vllm_rlt.bench.naive import NaiveOuro

    loops = model.config.num_loops
    rng = random.Random(args.seed + concurrency)
    vocab = model.config.vocab_size
    prefix = [rng.randrange(3, vocab) for _ in range(args.shared_prefix_len)]

    def fresh_prompts() -> list[list[int]]:
        """New prompts for every run (only the shared prefix repeats), so that no run finds
        an earlier run's prompts in the prefix cache."""
        return [
            prefix + [rng.randrange(3, vocab) for _ in range(args.prompt_len)]
            for _ in range(concurrency * args.waves)
        ]

    prompts = fresh_prompts()
    ids = [f"b{i}" for i in range(len(prompts))]
    if args.depth_trace_mean is not None:
        exit_config = ExitConfig(
            mode="trace",
            depths_by_request=make_traces(
                ids, args.output_len, args.depth_trace_mean, loops, args.seed
            ),
        )
        params = SamplingParams(max_tokens=max_tokens_of(args), temperature=0.0, ignore_eos=True)
    else:
        exit_config = ExitConfig()
        params = SamplingParams(
            max_tokens=max_tokens_of(args),
            temperature=0.0,
            ignore_eos=True,
            exit_threshold=1.0,
            max_loops=args.depth,
        )
    stop_after = args.output_len if max_tokens_of(args) > args.output_len else None
    kv_pool = "every request at once"
    engine_model = model if engine_model is None else engine_model
    try:
        engine = build_engine(engine_model, args, concurrency, exit_config)
    except ValueError as exc:
        if not str(exc).startswith("num_blocks:"):
            raise
        engine = build_engine(engine_model, args, concurrency, exit_config, whole_pool=False)
        kv_pool = f"sized to the device ({engine.kv.num_blocks} blocks): {exc}"
    progress.set_description(f"concurrency {concurrency}: engine")
    engine_runs = []
    for index in range(args.warmup + args.repeats):
        batch = prompts if index == 0 else fresh_prompts()
        timing = run_engine(engine, batch, params, stop_after)
        if index >= args.warmup:
            engine_runs.append(timing)
        progress.update(1)
    best = max(engine_runs, key=lambda r: r["decode_tokens_per_s"])
    result: dict[str, Any] = {
        "concurrency": concurrency,
        "kv_pool": kv_pool,
        # K/V bytes a context position holds; a prompt position while its prompt prefills
        # holds `kv_bytes_per_position_prefilling` (more only under shared_decode).
        "kv_bytes_per_position": engine.memory_plan.bytes_per_block // engine.kv.block_size,
        "kv_bytes_per_position_prefilling": engine.memory_plan.bytes_per_block
        // engine.kv.block_size
        * engine.scheduler.table_planes,
        # What holding blocks for prompt + max_tokens from admission on would let run.
        "full_reservation_at_once": min(
            concurrency,
            engine.kv.num_blocks // engine.kv.blocks_for(len(prompts[0]) + max_tokens_of(args) - 1),
        ),
        "spec_acceptance_rate": (
            engine.scheduler.num_accepted / engine.scheduler.num_drafted
            if engine.scheduler.num_drafted
            else None
        ),
        "prefix_cache_hit_rate": (
            engine.scheduler.prefix_hits / engine.scheduler.prefix_queries
            if engine.scheduler.prefix_queries
            else 0.0
        ),
        "execution": execution(engine),
        "engine": best,
        # Every timed run, so that steady-load figures carry their spread.
        "engine_runs_decode_tokens_per_s": [
            round(r["decode_tokens_per_s"], 1) for r in engine_runs
        ],
        "engine_median_decode_tokens_per_s": round(
            statistics.median(r["decode_tokens_per_s"] for r in engine_runs), 1
        ),
    }
    del engine
    if not args.no_baseline:
        naive_loops = args.depth if args.depth_trace_mean is None else loops
        batch = torch.tensor(prompts[:concurrency], device=model.device)  # one static batch
        baseline = []
        progress.set_description(f"concurrency {concurrency}: baseline")
        for _ in range(args.repeats + args.warmup):
            naive = NaiveOuro(model, concurrency, len(prompts[0]) + args.output_len)
            baseline.append(naive.generate(batch, args.output_len, naive_loops))
            del naive
            progress.update(1)
        base = max(baseline[args.warmup :], key=lambda r: r["decode_tokens_per_s"])
        result["baseline"] = base
        result["decode_ratio_vs_baseline"] = (
            best["decode_tokens_per_s"] / base["decode_tokens_per_s"]
        )
    if model.device.type == "cuda":
        result["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
        torch.cuda.reset_peak_memory_stats()
        at_once = min(concurrency, best["max_running"])  # the KV pool may hold fewer
        bound = roofline(
            engine_model, args, at_once, best["mean_loops"] or 1.0, copy_bandwidth(model.device)
        )
        bound["fraction_achieved"] = (
            best["decode_tokens_per_s"] / bound["decode_tokens_per_s_bound"]
        )
        result["roofline"] = bound
    return result


def copy_bandwidth(device: torch.device) -> float:
    """Measured device memory bandwidth in bytes/s (a 1 GiB copy reads and writes it)."""
    import torch

    source = torch.empty(2**29, dtype=torch.float16, device=device)
    target = torch.empty_like(source)
    for _ in range(3):
        target.copy_(source)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        target.copy_(source)
    end.record()
    end.synchronize()
    return 2 * source.numel() * source.element_size() * 10 / (start.elapsed_time(end) / 1e3)


def roofline(model, args, concurrency: int, mean_loops: float, bandwidth: float) -> dict:
    """Decode tokens/s if every pass only streamed the layer weights once plus each row's
    keys and values (one plane) at the mean context, at the measured bandwidth."""
    from vllm_rlt.layers.fp8 import kv_cache_torch_dtype, weight_nbytes

    cfg = model.config
    element = model.dtype.itemsize
    kv_element = kv_cache_torch_dtype(args.kv_cache_dtype, model.dtype).itemsize
    layer_bytes = sum(
        weight_nbytes(t)
        for layer in model.layers
        for t in (layer.qkv, layer.o, layer.gate_up, layer.down)
    )
    head_bytes = model.lm_head.numel() * element
    mean_context = args.shared_prefix_len + args.prompt_len + args.output_len / 2
    kv_bytes = (
        concurrency
        * mean_context
        * cfg.num_hidden_layers
        * 2
        * cfg.num_key_value_heads
        * cfg.head_dim
        * kv_element
    )
    pass_bytes = layer_bytes + kv_bytes + head_bytes
    seconds_per_token = mean_loops * pass_bytes / bandwidth
    return {
        "bandwidth_gb_s": bandwidth / 1e9,
        "bytes_per_pass": pass_bytes,
        "decode_tokens_per_s_bound": concurrency / seconds_per_token,
    }


def environment(device: torch.device) -> dict[str, Any]:
    import torch

    info = {"torch": torch.__version__, "python": platform.python_version()}
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
        try:
            import triton

            info["triton"] = triton.__version__
        except ImportError:
            info["triton"] = None
    else:
        info["cpu"] = platform.processor() or platform.machine()
    return info


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


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from vllm_rlt.bench.shapes import random_model
    from vllm_rlt.layers.fp8 import quantize_model
    from vllm_rlt.models.load import resolve_device, resolve_dtype

    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    torch.manual_seed(args.seed)
    model = random_model(args.shape, dtype, device, args.seed)
    engine_model = model
    if args.quantization is not None and args.no_baseline:
        quantize_model(model, args.quantization)  # nothing needs the unquantized one
    elif args.quantization is not None:  # the baseline keeps the unquantized weights
        engine_model = random_model(args.shape, dtype, device, args.seed)
        quantize_model(engine_model, args.quantization)
    if args.depth is None and args.depth_trace_mean is None:
        args.depth = model.config.num_loops
    if args.depth is not None and not 1 <= args.depth <= model.config.num_loops:
        raise ValueError(f"--depth must be in [1, {model.config.num_loops}], got {args.depth}")
    command = command_line(args)
    total = runs_per_concurrency(args) * len(args.concurrency)
    with tqdm(total=total, desc="throughput", unit="run", file=sys.stderr) as progress:
        results = [
            bench_concurrency(model, args, c, progress, engine_model) for c in args.concurrency
        ]
    # Every engine is built from the same settings on the same device, so the first one's
    # execution settings are every result's (each result also carries its own).
    report = {
        "benchmark": "throughput",
        "command": command,
        "environment": environment(device),
        "shape": args.shape,
        "dtype": str(dtype).removeprefix("torch."),
        "workload": {
            "prompt_len": args.prompt_len,
            "shared_prefix_len": args.shared_prefix_len,
            "enable_prefix_caching": args.enable_prefix_caching,
            "output_len": args.output_len,
            "waves": args.waves,
            "max_tokens": max_tokens_of(args),
            "depth": None if args.depth_trace_mean is not None else args.depth,
            "depth_trace_mean": args.depth_trace_mean,
            "kv_layout": args.kv_layout,
            "quantization": args.quantization,
            "kv_cache_dtype": args.kv_cache_dtype,
            "mode": args.mode,
            "speculative_tokens": args.speculative_tokens,
            "draft_loops": args.draft_loops if args.speculative_tokens is not None else None,
            "spec_acceptance_rate": args.spec_acceptance_rate,
            "attention_backend_requested": args.attention_backend,
            **results[0]["execution"],
        },
        "results": results,
    }
    return report


def main(argv: list[str] | None = None) -> int:
    parser = CLIParser(prog="vllm-rlt bench throughput", description=__doc__)
    add_arguments(parser)
    args = parser.parse_args(argv)
    check_minimums(
        parser,
        args,
        prompt_len=1,
        output_len=1,
        block_size=1,
        repeats=1,
        waves=1,
        warmup=0,
        shared_prefix_len=0,
        concurrency=1,
    )
    if args.waves > MAX_WAVES:
        parser.error(f"--waves must be in [1, {MAX_WAVES}], got {args.waves}")
    if args.max_tokens is not None and args.max_tokens < args.output_len:
        parser.error(
            f"--max-tokens must be >= --output-len ({args.output_len}), got {args.max_tokens}"
        )
    return run_and_emit(parser, run, args)


if __name__ == "__main__":
    sys.exit(main())
