"""Size the KV cache: around the device memory one maximum-size pass needs (measured) and
what the CUDA graphs keep, or as the user asked, checked against free memory."""

from __future__ import annotations

import torch

from vllm_rlt.config import CPU_DEFAULT_BLOCKS, CacheConfig, ExecutionConfig, SchedulerConfig
from vllm_rlt.core.memory import (
    MemoryPlan,
    check_explicit_plan,
    plan_from_profile,
    plan_kv_cache,
)
from vllm_rlt.layers.fp8 import kv_cache_torch_dtype
from vllm_rlt.layers.sampler import SamplingTensors, sample, token_logprobs
from vllm_rlt.models.interface import LoopedModel, StepInputs
from vllm_rlt.ops.base import LoopOps
from vllm_rlt.ops.metadata import AttentionMetadata, Segments
from vllm_rlt.sampling_params import MAX_LOGPROBS
from vllm_rlt.worker.mixed_graphs import buffer_bytes, mixed_sizes, sampler_sizes


def _profile_metadata(rows: int, planes: int, block_size: int, device) -> AttentionMetadata:
    """Every row at position 0 of a one-block cache: full-size activations, no real KV."""
    zeros = torch.zeros(rows, dtype=torch.int64, device=device)
    return AttentionMetadata(
        positions=zeros,
        row_tables=zeros,
        read_plane=zeros,
        write_lo=zeros,
        write_hi=torch.full_like(zeros, planes),
        row_entry=zeros,
        block_table=torch.zeros(1, 1, dtype=torch.int64, device=device),
        planes=planes,
        slots_per_plane=block_size,
        block_size=block_size,
        dummy_entry=0,
        segments=Segments(
            rows=torch.arange(rows, device=device).unsqueeze(1),
            q_pos=zeros.unsqueeze(1),
            kv_index=zeros.unsqueeze(1),
            kv_pos=zeros.unsqueeze(1),
        ),
    )


@torch.inference_mode()
def peak_pass_bytes(
    model: LoopedModel,
    ops: LoopOps,
    rows: int,
    samplers: int,
    planes: int,
    block_size: int,
    kv_dtype: torch.dtype,
) -> int:
    """Extra bytes allocated at peak by a pass of `rows` rows sampling `samplers` of them,
    over a K/V cache of `kv_dtype`."""
    cfg, device = model.config, model.device
    plan = cfg.kv_planes(planes)
    caches = [
        torch.zeros(
            layer_planes * block_size,
            cfg.num_key_value_heads,
            cfg.head_dim,
            dtype=kv_dtype,
            device=device,
        )
        for layer_planes in plan + plan
    ]
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    meta = _profile_metadata(rows, planes, block_size, device)
    tokens = torch.zeros(rows, dtype=torch.int64, device=device)
    inputs = StepInputs(
        tokens,
        torch.zeros(rows, model.carried_width, dtype=model.dtype, device=device),
        tokens,
        tokens if model.draws_initial_state else None,
    )
    k_caches, v_caches = caches[: len(plan)], caches[len(plan) :]
    hidden = model.step(inputs, meta, k_caches, v_caches, ops)
    live = torch.ones(rows, dtype=torch.bool, device=device)
    readout = model.readout(hidden, live, meta, k_caches, v_caches, ops)
    logits = model.coda(readout[:samplers])
    settings = SamplingTensors.filled(samplers, device, temperature=1.0)
    ids = sample(logits, settings, tokens[:samplers])
    token_logprobs(logits, ids, MAX_LOGPROBS)
    del hidden, readout, inputs, logits, ids
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - base
    del caches
    torch.cuda.empty_cache()
    return peak


def plan_memory(
    model: LoopedModel,
    ops: LoopOps,
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
            + buffer_bytes(model, stack)
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
