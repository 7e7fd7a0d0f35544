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
import random
import statistics
import sys
from typing import Any

from tqdm import tqdm

from vllm_rlt.bench.device_figures import copy_bandwidth, environment, roofline
from vllm_rlt.bench.report import check_minimums, run_and_emit
from vllm_rlt.bench.throughput_engine import (
    build_engine,
    execution,
    exit_setup,
    max_tokens_of,
    run_engine,
    sampling_fields,
)
from vllm_rlt.bench.throughput_flags import add_arguments, command_line
from vllm_rlt.cli_parser import CLIParser
from vllm_rlt.config import MAX_SYNC_PASSES
from vllm_rlt.sampling_params import SamplingParams

MAX_WAVES = 1000  # a typo of a few digits must not build billions of prompts


def runs_per_concurrency(args: argparse.Namespace) -> int:
    """Timed and warmup runs of the engine, and of the baseline unless it is skipped."""
    return (args.warmup + args.repeats) * (1 if args.no_baseline else 2)


def bench_concurrency(
    model, args, concurrency: int, progress: tqdm, engine_model=None
) -> dict[str, Any]:
    """One concurrency's runs: the engine runs `engine_model` (the model, or its quantized
    copy under --quantization), the naive baseline the unquantized model."""
    import torch

    from vllm_rlt.bench.naive import naive_baseline

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
    exit_config, params = exit_setup(args, ids, loops)
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
            naive = naive_baseline(model, concurrency, len(prompts[0]) + args.output_len)
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


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from vllm_rlt.bench.shapes import random_model
    from vllm_rlt.models.load import resolve_device, resolve_dtype

    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    torch.manual_seed(args.seed)
    model = random_model(args.shape, dtype, device, args.seed)
    engine_model = model
    if args.quantization is not None and args.no_baseline:
        model.quantize(args.quantization)  # nothing needs the unquantized one
    elif args.quantization is not None:  # the baseline keeps the unquantized weights
        engine_model = random_model(args.shape, dtype, device, args.seed)
        engine_model.quantize(args.quantization)
    if args.depth is None and args.depth_trace_mean is None:
        args.depth = model.config.num_loops
    if args.depth is not None and not 1 <= args.depth <= model.config.num_loops:
        raise ValueError(f"--depth must be in [1, {model.config.num_loops}], got {args.depth}")
    if args.exit_sync_passes is not None and not 1 <= args.exit_sync_passes <= MAX_SYNC_PASSES:
        raise ValueError(
            f"--exit-sync-passes must be in [1, {MAX_SYNC_PASSES}], got {args.exit_sync_passes}"
        )
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
            "temperature": args.temperature,
            "top_p": args.top_p,
            "top_k": args.top_k,
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
    try:  # the sampling flags' ranges, before any model is built
        SamplingParams(**sampling_fields(args))
    except ValueError as exc:
        parser.error(str(exc))
    if args.max_tokens is not None and args.max_tokens < args.output_len:
        parser.error(
            f"--max-tokens must be >= --output-len ({args.output_len}), got {args.max_tokens}"
        )
    return run_and_emit(parser, run, args)


if __name__ == "__main__":
    sys.exit(main())
