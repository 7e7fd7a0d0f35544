"""vLLM's names for `LLM(...)` arguments, mapped onto this engine's configs, so that code
written for `vllm.LLM` runs with only its import changed. A vLLM argument this engine does
not implement is an error naming it, never silently dropped."""

from __future__ import annotations

import dataclasses
from typing import Any

from vllm_rlt.config import (
    CacheConfig,
    ExecutionConfig,
    ParamError,
    SchedulerConfig,
)

# vLLM name -> (config, field): the value goes to that field of that config.
CONFIG_FIELDS = {
    "seed": ("execution_config", "seed"),
    "gpu_memory_utilization": ("cache_config", "gpu_memory_utilization"),
    "kv_cache_memory_bytes": ("cache_config", "kv_cache_memory_bytes"),
    "enable_prefix_caching": ("cache_config", "enable_prefix_caching"),
    "block_size": ("cache_config", "block_size"),
    "kv_cache_dtype": ("cache_config", "kv_cache_dtype"),
    "max_num_seqs": ("scheduler_config", "max_num_seqs"),
    "max_num_batched_tokens": ("scheduler_config", "max_num_batched_tokens"),
    "scheduling_policy": ("scheduler_config", "scheduling_policy"),
}
# Accepted and without effect, each for its reason.
HARMLESS = {
    "trust_remote_code": "this engine never runs code shipped with a checkpoint",
    "tokenizer_mode": "the tokenizer is always the model's tokenizer.json",
    "disable_log_stats": "statistics are kept without cost and logged nowhere",
}


def apply_vllm_args(
    names: dict[str, Any],
    cache_config: CacheConfig | None,
    scheduler_config: SchedulerConfig | None,
    execution_config: ExecutionConfig | None,
) -> tuple[CacheConfig, SchedulerConfig, ExecutionConfig]:
    """The configs with vLLM's names applied (a name set to None keeps the config's value);
    ParamError names an argument this engine does not know."""
    configs: dict[str, Any] = {
        "cache_config": cache_config or CacheConfig(),
        "scheduler_config": scheduler_config or SchedulerConfig(),
        "execution_config": execution_config or ExecutionConfig(),
    }
    changes: dict[str, dict[str, Any]] = {name: {} for name in configs}
    for name, value in names.items():
        if name == "enforce_eager":
            if value is not None:
                changes["execution_config"]["cuda_graphs"] = not value
        elif name in CONFIG_FIELDS:
            config, field = CONFIG_FIELDS[name]
            if value is not None:
                changes[config][field] = value
        elif name not in HARMLESS:
            raise ParamError(
                f"got the argument {name!r}, which this engine does not support; "
                "help(vllm_rlt.LLM) lists the vLLM arguments it takes",
                name,
            )
    for config, fields in changes.items():
        if fields:
            configs[config] = dataclasses.replace(configs[config], **fields)
    return configs["cache_config"], configs["scheduler_config"], configs["execution_config"]
