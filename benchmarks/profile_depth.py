"""Where a decode pass goes at fixed depth and under a replayed depth trace, in steady state:
each case's wall time a pass over a window of passes in the middle of the run, and its
device time a pass by kernel, then the kernels that the trace adds or removes a pass. For
prelude / block / coda models (Huginn-0125) the difference is the once-per-token work
(prelude, coda, LM head) that exits and entries bring into passes that a fixed-depth
batch, whose rows exit together, runs once in `depth` passes. Takes `vllm-rlt bench
throughput`'s flags for the model shape, engine and workload (not its run counts: --warmup,
--repeats and --no-baseline do not apply). Needs a CUDA GPU.

python -m benchmarks.profile_depth --shape huginn-3.5b --concurrency 64 --output-len 256 \
    --waves 4 --depth-trace-mean 16 [--exit-sync-passes 2] [--output profile.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import random
import sys
import time

import torch

from vllm_rlt.bench.shapes import random_model
from vllm_rlt.bench.throughput_engine import build_engine, exit_setup
from vllm_rlt.bench.throughput_flags import add_arguments
from vllm_rlt.cli_parser import CLIParser
from vllm_rlt.sampling_params import RequestOutputKind


def profile_case(model, args: argparse.Namespace, skip: int, window: int) -> dict:
    """Run the workload and profile passes skip..skip+window-1: their wall time and each
    kernel's device time, per pass."""
    from vllm_rlt.engine.llm_engine import LLMEngine

    concurrency = args.concurrency[0]
    rng = random.Random(args.seed)
    vocab = model.config.vocab_size
    prefix = [rng.randrange(3, vocab) for _ in range(args.shared_prefix_len)]  # as bench's
    prompts = [
        prefix + [rng.randrange(3, vocab) for _ in range(args.prompt_len)]
        for _ in range(concurrency * args.waves)
    ]
    ids = [f"p{i}" for i in range(len(prompts))]
    exit_config, params = exit_setup(args, ids, model.config.num_loops)
    engine = build_engine(model, args, concurrency, exit_config)
    frontend = LLMEngine(engine, None)
    params = dataclasses.replace(params, output_kind=RequestOutputKind.DELTA)
    for rid, prompt in zip(ids, prompts, strict=True):
        frontend.add_request(rid, prompt, params)
    for _ in range(skip):
        frontend.step()
    running = len(engine.scheduler.running)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        for _ in range(window):
            frontend.step()
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    kernels = {  # us a pass, inside the graphs too
        event.key: event.device_time_total / window
        for event in prof.key_averages()
        if event.device_time_total > 0
    }
    for rid in ids:
        frontend.abort_request(rid)
    del frontend, engine
    gc.collect()  # the engine's graphs and K/V, before the next case's engine
    torch.cuda.empty_cache()
    return {
        "pass_ms": wall / window * 1e3,
        "device_us_per_pass": sum(kernels.values()),
        "running": running,
        "kernels_us_per_pass": dict(sorted(kernels.items(), key=lambda kv: -kv[1])),
    }


def print_case(name: str, case: dict, top: int) -> None:
    print(
        f"{name}: {case['pass_ms']:.3f} ms a pass (wall), {case['device_us_per_pass']:.0f} us "
        f"of kernels, {case['running']} rows running"
    )
    for kernel, us in list(case["kernels_us_per_pass"].items())[:top]:
        print(f"  {us:9.1f} us  {kernel[:90]}")


def print_difference(fixed: dict, trace: dict, top: int) -> None:
    """The kernels whose time a pass the trace changes most, largest first."""
    names = set(fixed["kernels_us_per_pass"]) | set(trace["kernels_us_per_pass"])
    delta = {
        name: trace["kernels_us_per_pass"].get(name, 0.0)
        - fixed["kernels_us_per_pass"].get(name, 0.0)
        for name in names
    }
    total = trace["device_us_per_pass"] - fixed["device_us_per_pass"]
    print(f"trace - fixed: {total:+.0f} us of kernels a pass, by kernel:")
    for name, us in sorted(delta.items(), key=lambda kv: -abs(kv[1]))[:top]:
        print(f"  {us:+9.1f} us  {name[:90]}")


def main(argv: list[str] | None = None) -> int:
    parser = CLIParser(prog="python -m benchmarks.profile_depth", description=__doc__)
    add_arguments(parser)
    parser.set_defaults(shape="huginn-3.5b", concurrency=[64], output_len=256, waves=4)
    parser.add_argument(
        "--skip-passes", type=int, default=200, help="passes run before the profiled window"
    )
    parser.add_argument("--window", type=int, default=100, help="passes profiled per case")
    parser.add_argument("--top", type=int, default=16, help="kernels listed per table")
    args = parser.parse_args(argv)
    if args.depth_trace_mean is None:
        parser.error("--depth-trace-mean is required: the trace is profiled against fixed depth")
    if len(args.concurrency) != 1:
        parser.error("--concurrency takes one value here")
    parser.require_cuda()
    model = random_model(args.shape, torch.bfloat16, torch.device("cuda"), args.seed)
    if args.quantization is not None:
        model.quantize(args.quantization)
    fixed_args = argparse.Namespace(**{**vars(args), "depth_trace_mean": None})
    report = {"device": torch.cuda.get_device_name(), "command": " ".join(sys.argv)}
    report["fixed"] = profile_case(model, fixed_args, args.skip_passes, args.window)
    print_case(f"fixed depth {model.config.num_loops}", report["fixed"], args.top)
    report["trace"] = profile_case(model, args, args.skip_passes, args.window)
    print_case(f"trace, mean {args.depth_trace_mean}", report["trace"], args.top)
    print_difference(report["fixed"], report["trace"], args.top)
    if args.output:
        with open(args.output, "w") as out:
            json.dump(report, out, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
