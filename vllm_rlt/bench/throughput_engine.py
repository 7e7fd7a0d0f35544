"""The engine side of the throughput benchmark: the engine its flags describe, the exit
depths it replays, and one batch run to completion with every token's time."""

from __future__ import annotations

import argparse
import dataclasses
import math
import random
import statistics
import time
from typing import TYPE_CHECKING, Any

from vllm_rlt.bench.report import percentile
from vllm_rlt.config import CacheConfig, ExecutionConfig, ExitConfig, SchedulerConfig
from vllm_rlt.entrypoints.args import speculative_config
from vllm_rlt.sampling_params import RequestOutputKind, SamplingParams

if TYPE_CHECKING:  # torch and the engine load when a run starts, not to parse flags
    from vllm_rlt.engine.engine_core import EngineCore


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


def exit_setup(
    args: argparse.Namespace, ids: list[str], loops: int
) -> tuple[ExitConfig, SamplingParams]:
    """The exit config and sampling params of a run: every token at --depth loops (under
    every family's exit policy), or with --depth-trace-mean each request's replayed trace."""
    if args.depth_trace_mean is not None:
        traces = make_traces(ids, args.output_len, args.depth_trace_mean, loops, args.seed)
        exit_config = ExitConfig(
            mode="trace", depths_by_request=traces, sync_passes=args.exit_sync_passes
        )
        return exit_config, SamplingParams(**sampling_fields(args))
    params = SamplingParams(**sampling_fields(args), min_loops=args.depth, max_loops=args.depth)
    return ExitConfig(sync_passes=args.exit_sync_passes), params


def sampling_fields(args: argparse.Namespace) -> dict:
    """Every request's sampling: --temperature / --top-p / --top-k seeded with --seed, to
    the end of its output."""
    return dict(
        max_tokens=max_tokens_of(args),
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        ignore_eos=True,
    )


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
    from vllm_rlt.engine_config import DeviceConfig, EngineConfig

    prompt_len = args.shared_prefix_len + args.prompt_len
    max_len = prompt_len + max_tokens_of(args)
    per_request = -(-max_len // args.block_size)
    if args.kv_layout == "shared_decode":  # one-plane blocks, every loop's while prefilling
        per_request += (model.config.num_loops - 1) * -(-prompt_len // args.block_size)
    blocks = concurrency * per_request + 8 if whole_pool else None
    return build_engine_core(
        model,
        None,
        EngineConfig(
            cache_config=CacheConfig(
                layout=args.kv_layout,
                block_size=args.block_size,
                kv_cache_dtype=args.kv_cache_dtype,
                num_blocks=blocks,
                enable_prefix_caching=args.enable_prefix_caching,
            ),
            scheduler_config=SchedulerConfig(
                mode=args.mode,
                max_num_seqs=max(concurrency, 1),
                max_num_batched_tokens=max(concurrency * prompt_len, 2048),
                prefill_chunk_size=max(prompt_len, 1),
                max_prefill_batches_before_decode=max(concurrency, 1),
            ),
            exit_config=exit_config,
            execution_config=ExecutionConfig(
                cuda_graphs=not args.enforce_eager, async_scheduling=args.async_scheduling
            ),
            speculative_config=speculative_config(args),
            device_config=DeviceConfig(
                device=str(model.device), attention_backend=args.attention_backend
            ),
        ),
    )


def execution(engine: EngineCore) -> dict[str, Any]:
    """What the built engine actually runs with (CUDA graphs only exist on CUDA, async
    scheduling only in refill mode, "auto" resolves to one backend, exit sync to a count)."""
    sync = engine.runner.head.sync
    return {
        "cuda_graphs": engine.runner.graphs is not None,
        "async_scheduling": engine.async_scheduling,
        "attention_backend": engine.attention_backend,
        "exit_sync_passes": 1 if sync is None else sync.passes,
    }
