"""KV cache sizing: how many blocks the pool gets, and why (the MemoryPlan)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

CPU_DEFAULT_BLOCKS = 256


@dataclass(frozen=True)
class MemoryPlan:
    """The outcome of sizing, kept on the engine (never written back into a config)."""

    num_blocks: int
    block_size: int
    planes: int
    bytes_per_block: int
    source: str  # "num_blocks" | "kv_cache_memory_bytes" | "cpu_default" | "gpu_profile"

    @property
    def kv_cache_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block


def bytes_per_block(model_config, planes: int, block_size: int, dtype: torch.dtype) -> int:
    """K and V for every layer and plane of one block."""
    element = torch.empty((), dtype=dtype).element_size()
    per_token = 2 * model_config.num_key_value_heads * model_config.head_dim * element
    return per_token * block_size * planes * model_config.num_hidden_layers


def plan_kv_cache(cache_config, model_config, planes: int, dtype: torch.dtype) -> MemoryPlan:
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
        blocks, source = CPU_DEFAULT_BLOCKS, "cpu_default"
    return MemoryPlan(blocks, cache_config.block_size, planes, per_block, source)
