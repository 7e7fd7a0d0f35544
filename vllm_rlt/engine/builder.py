"""Builds an engine from the user's arguments: loads the model and its tokenizer, joins a
tensor-parallel group (rank 0 starts the other ranks), and constructs the `EngineCore`.
The offline `LLM`, the engine-core process and every tensor-parallel rank build their
engine here and only here."""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch

from vllm_rlt.config import (
    OFFLINE,
    CacheConfig,
    ExecutionConfig,
    ExitConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from vllm_rlt.engine.engine_core import EngineCore
from vllm_rlt.engine.parent_watch import leave_with_parent
from vllm_rlt.models.load import load_model_and_tokenizer, resolve_device, resolve_dtype
from vllm_rlt.parallel.tensor_parallel import (
    TensorParallel,
    check_tensor_parallel,
    follow,
    free_port,
    join_group,
    rank_device,
    shard_model,
    start_followers,
    stop_followers,
)
from vllm_rlt.tokenizer import Tokenizer


@dataclass
class BuiltEngine:
    engine: EngineCore
    tokenizer: Tokenizer | None
    model_name: str
    tensor_parallel: TensorParallel | None  # this rank's place in its group, if any


def build_engine(
    model: str | None = None,
    device: str | torch.device = "cpu",
    dtype: str | torch.dtype = "auto",
    cache_config: CacheConfig | None = None,
    scheduler_config: SchedulerConfig | None = None,
    exit_config: ExitConfig | None = None,
    execution_config: ExecutionConfig | None = None,
    attention_backend: str = "auto",
    speculative_config: SpeculativeConfig | None = None,
    tensor_parallel_size: int = 1,
    usage_context: str = OFFLINE,
    tensor_parallel_rank: tuple[int, int] | None = None,
) -> BuiltEngine:
    """The arguments are `LLM`'s (see there). `tensor_parallel_rank` (rank, port) is given
    only to ranks other than 0, which rank 0 starts itself."""
    resolved_device = resolve_device(device)
    resolved_dtype = resolve_dtype(dtype, resolved_device)
    rank, port = tensor_parallel_rank or (0, 0)
    loaded, tokenizer, name = load_model_and_tokenizer(
        model, resolved_dtype, rank_device(resolved_device, rank)
    )
    followers: list[Any] = []
    if tensor_parallel_size != 1:
        check_tensor_parallel(tensor_parallel_size, loaded.config, resolved_device)
        if rank == 0:
            port = free_port()
            same_arguments = {
                "model": model,
                "device": device,
                "dtype": dtype,
                "cache_config": cache_config,
                "scheduler_config": scheduler_config,
                "exit_config": exit_config,
                "execution_config": execution_config,
                "attention_backend": attention_backend,
                "speculative_config": speculative_config,
                "usage_context": usage_context,
            }
            followers = start_followers(
                tensor_parallel_size, port, run_tensor_parallel_rank, same_arguments
            )
    tensor_parallel = None
    try:
        if tensor_parallel_size != 1:
            tensor_parallel = join_group(
                rank, tensor_parallel_size, port, resolved_device, followers
            )
            shard_model(loaded, tensor_parallel)
        engine = EngineCore(
            loaded,
            tokenizer,
            cache_config or CacheConfig(),
            scheduler_config or SchedulerConfig(),
            exit_config or ExitConfig(),
            execution_config or ExecutionConfig(),
            attention_backend,
            speculative_config,
            tensor_parallel,
            usage_context,
        )
    except BaseException:
        if tensor_parallel is not None:
            tensor_parallel.close()
        for process in followers:
            process.kill()
        raise
    if tensor_parallel is not None and rank == 0:
        engine.mirror = tensor_parallel.mirror
        weakref.finalize(engine, stop_followers, tensor_parallel, followers)
    return BuiltEngine(engine, tokenizer, name, tensor_parallel)


def run_tensor_parallel_rank(
    rank: int, world: int, port: int, arguments: dict[str, Any], parent_pid: int
) -> None:
    """A rank other than 0 (its own process): build the engine as rank 0 does, then make
    every call rank 0 mirrors until it says stop. It leaves with its parent."""
    leave_with_parent(parent_pid)
    built = build_engine(**arguments, tensor_parallel_size=world, tensor_parallel_rank=(rank, port))
    assert built.tensor_parallel is not None
    follow(built.engine, built.tensor_parallel)
