"""KV sizing arithmetic: explicit sizes, byte budgets and the profiled GPU plan."""

from __future__ import annotations

import pytest
import torch

from vllm_rlt.config import CPU_DEFAULT_BLOCKS, CacheConfig
from vllm_rlt.core.memory import (
    DEFAULT_RESERVE_BYTES,
    bytes_per_block,
    check_explicit_plan,
    plan_from_profile,
    plan_kv_cache,
)
from vllm_rlt.models.ouro import OuroConfig
from vllm_rlt.models.toy import toy_config_dict

CONFIG = OuroConfig.from_dict(toy_config_dict())
GIB = 2**30


def test_bytes_per_block_counts_k_and_v_for_every_layer_and_plane():
    # 2 (K, V) * 2 kv heads * 16 dims * 4 bytes * 16 positions * 4 planes * 2 layers
    assert bytes_per_block(CONFIG, 4, 16, torch.float32) == 2 * 2 * 16 * 4 * 16 * 4 * 2
    assert bytes_per_block(CONFIG, 1, 16, torch.bfloat16) == 2 * 2 * 16 * 2 * 16 * 1 * 2


def test_explicit_and_default_sizes():
    assert plan_kv_cache(CacheConfig(num_blocks=7), CONFIG, 4, torch.float32).num_blocks == 7
    per_block = bytes_per_block(CONFIG, 4, 16, torch.float32)
    plan = plan_kv_cache(
        CacheConfig(kv_cache_memory_bytes=10 * per_block + 5), CONFIG, 4, torch.float32
    )
    assert (plan.num_blocks, plan.source) == (10, "kv_cache_memory_bytes")
    assert plan_kv_cache(CacheConfig(), CONFIG, 4, torch.float32).num_blocks == CPU_DEFAULT_BLOCKS
    with pytest.raises(ValueError, match="smaller than one KV block"):
        plan_kv_cache(CacheConfig(kv_cache_memory_bytes=1), CONFIG, 4, torch.float32)


def test_profiled_plan_subtracts_everything_measured():
    per_block = bytes_per_block(CONFIG, 4, 16, torch.bfloat16)
    plan = plan_from_profile(
        CacheConfig(gpu_memory_utilization=0.5),
        CONFIG,
        4,
        torch.bfloat16,
        total_bytes=80 * GIB,
        allocated_bytes=3 * GIB,
        pass_peak_bytes=2 * GIB,
        graph_bytes=1 * GIB,
        max_useful_blocks=10**9,
    )
    expected = (40 * GIB - 6 * GIB - DEFAULT_RESERVE_BYTES) // per_block
    assert plan.num_blocks == expected and plan.source == "gpu_profile"
    assert plan.details["kv_cache_bytes"] == expected * per_block
    capped = plan_from_profile(
        CacheConfig(), CONFIG, 4, torch.bfloat16, 80 * GIB, 0, 0, 0, max_useful_blocks=123
    )
    assert capped.num_blocks == 123


def test_profiled_plan_without_room_names_the_setting():
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        plan_from_profile(
            CacheConfig(gpu_memory_utilization=0.1), CONFIG, 4, torch.bfloat16, GIB, GIB, 0, 0, 10
        )


@pytest.mark.parametrize("field", ["num_blocks", "kv_cache_memory_bytes"])
def test_an_explicit_pool_too_large_for_the_device_is_refused_with_its_numbers(field):
    per_block = bytes_per_block(CONFIG, 4, 16, torch.bfloat16)
    room = 10 * GIB - 2 * GIB - 1 * GIB - DEFAULT_RESERVE_BYTES
    fits = room // per_block
    if field == "num_blocks":
        config = CacheConfig(num_blocks=fits + 1)
    else:
        config = CacheConfig(kv_cache_memory_bytes=(fits + 1) * per_block)
    plan = plan_kv_cache(config, CONFIG, 4, torch.bfloat16)
    with pytest.raises(ValueError) as caught:
        check_explicit_plan(plan, 10 * GIB, 2 * GIB, 1 * GIB, "cuda:0")
    message = str(caught.value)
    assert message.startswith(f"{field}: a KV cache of {fits + 1} blocks")
    assert "10.00 GiB free" in message and f"at most {fits} blocks" in message
    assert "\n" not in message
    exact = plan_kv_cache(CacheConfig(num_blocks=fits), CONFIG, 4, torch.bfloat16)
    check_explicit_plan(exact, 10 * GIB, 2 * GIB, 1 * GIB, "cuda:0")  # fits exactly
