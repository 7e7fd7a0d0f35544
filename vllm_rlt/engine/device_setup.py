"""What the engine's device side needs before the first request: the memory plan that
sizes the KV cache, the checks speculation makes of the other settings, and on CUDA the
graph captures and the warm-up of passes with prompt rows."""

from __future__ import annotations

from typing import Any

import torch

from vllm_rlt.config import (
    CacheConfig,
    ExecutionConfig,
    KVLayout,
    SchedulerConfig,
    SpeculativeConfig,
    require,
)
from vllm_rlt.core.memory import (
    CPU_DEFAULT_BLOCKS,
    MemoryPlan,
    check_explicit_plan,
    plan_from_profile,
    plan_kv_cache,
)
from vllm_rlt.layers.fp8 import kv_cache_torch_dtype
from vllm_rlt.worker.model_runner import ModelRunner


def plan_memory(
    model: Any,
    ops: Any,
    cache_config: CacheConfig,
    scheduler_config: SchedulerConfig,
    execution_config: ExecutionConfig,
    planes: int,
    table_planes: int,
    num_lanes: int,
    max_model_len: int,
) -> MemoryPlan:
    """The KV pool: the CPU default, a size the user gave (checked against free memory), or
    what the device holds beside the weights, the largest pass and the graphs, but no more
    than every sequence at `max_model_len` positions can use. `table_planes` one-plane
    blocks hold what one block of every plane holds, so defaults and caps count that many
    per position block under SHARED_DECODE."""
    cfg, device = model.config, model.device
    kv_dtype = kv_cache_torch_dtype(cache_config.kv_cache_dtype, model.dtype)
    explicit = cache_config.num_blocks is not None or cache_config.kv_cache_memory_bytes
    if device.type != "cuda":
        default = CPU_DEFAULT_BLOCKS * table_planes
        return plan_kv_cache(cache_config, cfg, planes, kv_dtype, default)
    from vllm_rlt.worker.memory_profile import peak_pass_bytes
    from vllm_rlt.worker.mixed_graphs import buffer_bytes, mixed_sizes, sampler_sizes

    seqs = scheduler_config.max_num_seqs
    rows = scheduler_config.max_num_batched_tokens
    samplers = seqs * num_lanes  # every speculation lane may need the LM head
    block_size = cache_config.block_size
    pass_peak = peak_pass_bytes(model, ops, rows, samplers, planes, block_size, kv_dtype)
    graph_pool = 0
    if execution_config.cuda_graphs and not ops.needs_segments:
        # Counted as a sum, though the graphs share one pool: the decode graphs (and the
        # prompt-pass heads, with their prompt samplers), the largest prompt-pass stack,
        # and the stack's output buffer.
        stack = mixed_sizes(rows)[-1]
        head_rows = samplers + sampler_sizes(seqs)[-1]
        graph_pool = (
            peak_pass_bytes(model, ops, head_rows, head_rows, planes, block_size, kv_dtype)
            + peak_pass_bytes(model, ops, stack, 1, planes, block_size, kv_dtype)
            + buffer_bytes(cfg, model.dtype, stack)
        )
    if explicit:
        plan = plan_kv_cache(cache_config, cfg, planes, kv_dtype)
        free, _ = torch.cuda.mem_get_info(device)
        # Memory the allocator holds but nothing uses (the profiled pass's) is free too.
        free += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        check_explicit_plan(plan, free, pass_peak, graph_pool, str(device))
        return plan
    total = torch.cuda.get_device_properties(device).total_memory
    per_seq = -(-max_model_len // block_size)
    return plan_from_profile(
        cache_config,
        cfg,
        planes,
        kv_dtype,
        total,
        torch.cuda.memory_allocated(device),
        pass_peak,
        graph_pool,
        seqs * per_seq * table_planes,
    )


def prepare_device(
    runner: ModelRunner, ops: Any, cuda_graphs: bool, max_num_batched_tokens: int
) -> None:
    """On CUDA: capture the decode graphs and the graphs of passes with prompt rows (when
    `cuda_graphs` and the attention backend allow), then warm up the passes with prompt rows
    that run eagerly. Elsewhere: nothing."""
    model = runner.model
    if model.device.type != "cuda":
        return
    if cuda_graphs and not ops.needs_segments:
        from vllm_rlt.worker.cuda_graphs import DecodeGraphs
        from vllm_rlt.worker.mixed_graphs import MixedGraphs, mixed_sizes

        runner.graphs = DecodeGraphs(
            runner.decode_pass,
            runner.dummy_slot,
            runner.uploads.upload,
            model.device,
            with_lanes=runner.lanes is not None,
        )
        runner.graphs.capture_all()
        runner.mixed = MixedGraphs(
            runner.prompt_pass_parts(), runner.graphs.pool, mixed_sizes(max_num_batched_tokens)
        )
        runner.mixed.capture_all()
    runner.warm_up_prompt_passes(sorted({1, max_num_batched_tokens}))


def check_speculation(
    config: SpeculativeConfig,
    num_loops: int,
    cache_config: CacheConfig,
    scheduler_config: SchedulerConfig,
    num_lanes: int,
) -> None:
    """Every setting speculation cannot work with, as one clear error naming it."""
    require(
        config.draft_loops < num_loops,
        f"draft_loops must be in [1, {num_loops - 1}] (below the model's {num_loops} loops), "
        f"got {config.draft_loops}",
        "draft_loops",
    )
    require(
        cache_config.layout is KVLayout.LAST_EXITED,
        "speculative decoding needs the last_exited KV layout (a drafted position reads each "
        f"earlier position at its own loop), got {cache_config.layout.value!r}",
        "kv_layout",
    )
    rows = scheduler_config.max_num_seqs * num_lanes
    require(
        rows <= scheduler_config.max_num_batched_tokens,
        f"max_num_batched_tokens must be at least max_num_seqs x {num_lanes} = {rows} (a "
        f"speculating request decodes in {num_lanes} rows per pass), got "
        f"{scheduler_config.max_num_batched_tokens}",
        "max_num_batched_tokens",
    )
    require(
        scheduler_config.mode == "refill",
        f"speculative decoding needs the refill scheduling mode, got {scheduler_config.mode!r}",
        "mode",
    )
