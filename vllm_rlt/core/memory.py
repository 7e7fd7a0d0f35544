"""KV cache sizing: how many blocks the pool gets, and why (the MemoryPlan)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_rlt.config import CPU_DEFAULT_BLOCKS

# Left free beyond what profiling measures: cuBLAS workspaces, allocator fragmentation.
DEFAULT_RESERVE_BYTES = 512 * 2**20


@dataclass(frozen=True)
class MemoryPlan:
    """The outcome of sizing, kept on the engine (never written back into a config).

    For "gpu_profile" the budget is `total * gpu_memory_utilization`, minus what is already
    allocated (weights), the measured peak of a maximum-size pass, the same again for the
    CUDA graphs' private pool, and the fixed reserve; the blocks are capped at what
    `max_num_seqs` requests of full context could use.
    """

    num_blocks: int
    block_size: int
    planes: int
    bytes_per_block: int
    source: str  # "num_blocks" | "kv_cache_memory_bytes" | "cpu_default" | "gpu_profile"
    details: dict[str, int] | None = None


def bytes_per_block(model_config, planes: int, block_size: int, dtype: torch.dtype) -> int:
    """K and V for every attention layer and plane of one block (`planes` for a looped
    layer, one for a layer that runs once per token)."""
    element = torch.empty((), dtype=dtype).element_size()
    per_token = 2 * model_config.num_key_value_heads * model_config.head_dim * element
    return per_token * block_size * sum(model_config.kv_planes(planes))


def plan_kv_cache(
    cache_config,
    model_config,
    planes: int,
    dtype: torch.dtype,
    default_blocks: int = CPU_DEFAULT_BLOCKS,
) -> MemoryPlan:
    """An explicit pool size, or `default_blocks` (the CPU default)."""
    per_block = bytes_per_block(model_config, planes, cache_config.block_size, dtype)
    if cache_config.num_blocks is not None:
        blocks, source = cache_config.num_blocks, "num_blocks"
    elif cache_config.kv_cache_memory_bytes is not None:
        blocks, source = cache_config.kv_cache_memory_bytes // per_block, "kv_cache_memory_bytes"
        if blocks < 1:
            raise ValueError(
                f"kv_cache_memory_bytes={cache_config.kv_cache_memory_bytes} is smaller than "
                f"one KV block ({per_block} bytes)"
            )
    else:
        blocks, source = default_blocks, "cpu_default"
    return MemoryPlan(blocks, cache_config.block_size, planes, per_block, source)


def plan_from_profile(
    cache_config,
    model_config,
    planes: int,
    dtype: torch.dtype,
    total_bytes: int,
    allocated_bytes: int,
    pass_peak_bytes: int,
    graph_bytes: int,
    max_useful_blocks: int,
) -> MemoryPlan:
    """Size the pool from a measured pass (see MemoryPlan)."""
    per_block = bytes_per_block(model_config, planes, cache_config.block_size, dtype)
    budget = int(total_bytes * cache_config.gpu_memory_utilization)
    free_for_kv = budget - allocated_bytes - pass_peak_bytes - graph_bytes - DEFAULT_RESERVE_BYTES
    blocks = min(free_for_kv // per_block, max_useful_blocks)
    if blocks < 1:
        raise ValueError(
            f"no room for the KV cache: gpu_memory_utilization="
            f"{cache_config.gpu_memory_utilization} of {total_bytes / 2**30:.1f} GiB leaves "
            f"{free_for_kv / 2**30:.2f} GiB after weights and activations; raise "
            "gpu_memory_utilization or lower max_num_batched_tokens"
        )
    details = {
        "total_bytes": total_bytes,
        "budget_bytes": budget,
        "allocated_before_kv_bytes": allocated_bytes,
        "pass_peak_bytes": pass_peak_bytes,
        "graph_pool_bytes": graph_bytes,
        "reserve_bytes": DEFAULT_RESERVE_BYTES,
        "kv_cache_bytes": blocks * per_block,
    }
    return MemoryPlan(blocks, cache_config.block_size, planes, per_block, "gpu_profile", details)


def _gib(count: int) -> str:
    return f"{count / 2**30:.2f} GiB"


def check_explicit_plan(
    plan: MemoryPlan,
    free_bytes: int,
    pass_peak_bytes: int,
    graph_bytes: int,
    device: str,
) -> None:
    """A pool sized by `num_blocks` or `kv_cache_memory_bytes` must fit in what the device
    has free (after the weights) beside a maximum-size pass, the CUDA graphs and the
    reserve: a one-line ValueError with the numbers before anything is allocated."""
    room = free_bytes - pass_peak_bytes - graph_bytes - DEFAULT_RESERVE_BYTES
    needed = plan.num_blocks * plan.bytes_per_block
    if needed <= room:
        return
    field = "num_blocks" if plan.source == "num_blocks" else "kv_cache_memory_bytes"
    fits = max(room // plan.bytes_per_block, 0)
    raise ValueError(
        f"{field}: a KV cache of {plan.num_blocks} blocks needs {_gib(needed)}, but {device} "
        f"has {_gib(free_bytes)} free, of which a maximum-size pass takes "
        f"{_gib(pass_peak_bytes)}, CUDA graphs {_gib(graph_bytes)} and the reserve "
        f"{_gib(DEFAULT_RESERVE_BYTES)}: at most {fits} blocks of {plan.bytes_per_block} bytes "
        "fit (leave num_blocks and kv_cache_memory_bytes unset to size the pool "
        "automatically)"
    )
