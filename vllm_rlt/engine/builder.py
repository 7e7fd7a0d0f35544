"""Builds an engine from its `EngineConfig`: loads the model and its tokenizer, joins a
tensor-parallel group (rank 0 starts the other ranks), and assembles the `EngineCore` from
its parts (scheduler defaults sized to the device, the memory plan and KV geometry, the
block pool, the scheduler, the runner with its graphs and warm-up, the request checks).
The offline `LLM`, the engine-core process and every tensor-parallel rank build their
engine here and only here."""

from __future__ import annotations

import dataclasses
import hashlib
import weakref
from dataclasses import dataclass
from typing import Any

from vllm_rlt.config import AUTO_SYNC_PASSES, KVLayout, require, require_int
from vllm_rlt.core.kv_cache_manager import KVCacheManager
from vllm_rlt.core.scheduler import Scheduler
from vllm_rlt.engine.device_defaults import size_scheduler
from vllm_rlt.engine.engine_core import EngineCore
from vllm_rlt.engine.parent_watch import leave_with_parent
from vllm_rlt.engine.process_setup import settle_engine_process
from vllm_rlt.engine.request_checks import RequestChecker, RequestLimits
from vllm_rlt.engine_config import EngineConfig
from vllm_rlt.exit.registry import make_exit_policy
from vllm_rlt.layers.fp8 import kv_cache_torch_dtype
from vllm_rlt.models.load import (
    load_model_and_tokenizer,
    model_eos_token_ids,
    resolve_device,
    resolve_dtype,
)
from vllm_rlt.ops.registry import get_backend
from vllm_rlt.parallel.tensor_parallel import (
    TensorParallel,
    check_tensor_parallel,
    follow,
    free_port,
    join_group,
    rank_device,
    start_followers,
    stop_followers,
)
from vllm_rlt.tokenizer import Tokenizer
from vllm_rlt.worker.memory_profile import plan_memory
from vllm_rlt.worker.model_runner import ModelRunner
from vllm_rlt.worker.pass_inputs import KVGeometry
from vllm_rlt.worker.spec_lanes import SpecLanes, check_speculation, lanes_per_request


@dataclass
class BuiltEngine:
    engine: EngineCore
    tokenizer: Tokenizer | None
    model_name: str
    tensor_parallel: TensorParallel | None  # this rank's place in its group, if any


def build_engine(
    config: EngineConfig, tensor_parallel_rank: tuple[int, int] | None = None
) -> BuiltEngine:
    """Load `config`'s model and build its engine. `tensor_parallel_rank` (rank, port) is
    given only to ranks other than 0, which rank 0 starts itself."""
    model_config, device_config = config.model_config, config.device_config
    tensor_parallel_size = config.parallel_config.tensor_parallel_size
    resolved_device = resolve_device(device_config.device)
    resolved_dtype = resolve_dtype(model_config.dtype, resolved_device)
    rank, port = tensor_parallel_rank or (0, 0)
    loaded, loaded_tokenizer, name = load_model_and_tokenizer(
        model_config.model,
        resolved_dtype,
        rank_device(resolved_device, rank),
        model_config.tokenizer,
        model_config.skip_tokenizer_init,
    )
    # Before sharding, so that every rank holds the single-process model's values and
    # scales (a rank's share of o and down keeps the whole rows' scales).
    loaded.quantize(model_config.quantization)
    followers: list[Any] = []
    if tensor_parallel_size != 1:
        check_tensor_parallel(tensor_parallel_size, loaded.config, resolved_device)
        if rank == 0:
            port = free_port()
            followers = start_followers(
                tensor_parallel_size, port, run_tensor_parallel_rank, config
            )
    tensor_parallel = None
    try:
        if tensor_parallel_size != 1:
            tensor_parallel = join_group(
                rank, tensor_parallel_size, port, resolved_device, followers
            )
            loaded.shard(tensor_parallel)
        engine = build_engine_core(
            loaded,
            loaded_tokenizer,
            config,
            tensor_parallel,
            model_eos_token_ids(model_config.model, loaded.config.vocab_size),
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
    return BuiltEngine(engine, loaded_tokenizer, name, tensor_parallel)


def run_tensor_parallel_rank(rank: int, port: int, config: EngineConfig, parent_pid: int) -> None:
    """A rank other than 0 (its own process): build the engine as rank 0 does, then make
    every call rank 0 mirrors until it says stop. It leaves with its parent."""
    leave_with_parent(parent_pid)
    built = build_engine(config, tensor_parallel_rank=(rank, port))
    assert built.tensor_parallel is not None
    settle_engine_process(built.engine.model.device)
    follow(built.engine, built.tensor_parallel)
    if built.engine.disagg is not None:  # its share of a disaggregated core's pool
        built.engine.disagg.close()


def check_stages(model, cache_config, disaggregate) -> None:
    """What a model with layers after its loop (`separate_readout`: Huginn's coda) cannot
    run with yet, as one clear error naming the setting."""
    if not model.separate_readout:
        return
    require(
        cache_config.layout is not KVLayout.SHARED_DECODE,
        "kv_layout 'shared_decode' is not implemented for models whose layers outside the "
        "loop keep K/V of their own (Huginn): use 'last_exited' or 'shared'",
        "kv_layout",
    )
    require(
        not disaggregate,
        "prefill/decode disaggregation is not implemented for Huginn models yet",
        "disaggregate",
    )


def check_speculated_exits(model, exit_policy, mode: str) -> None:
    """Speculation with an exit rule that reads the logits of a model with layers after its
    loop is refused: a lane checks its token while the position before it still loops, so
    the coda it runs would attend over that position's unfinished coda K/V, and its exit
    depth would not be plain decoding's."""
    require(
        not (model.separate_readout and exit_policy.needs_logits),
        f"speculative decoding cannot run with exit mode {mode!r} on this model: its exit "
        "checks run the coda, which would read the K/V of a token still being computed; use "
        "exit mode 'latent_diff' or 'trace', or no speculative decoding",
        "speculative_config",
    )


def exit_sync_passes(sync_passes: int | None, model, exit_policy, speculating: bool) -> int:
    """ExitConfig.sync_passes for this model and policy. Exits held back together share the
    layers after the loop: None holds them (AUTO_SYNC_PASSES) where that saves streaming,
    and more than 1 is refused, by name, where there are no such layers, the policy runs
    them for every row anyway, or speculation lanes hold exits back on their own terms."""
    saves = model.separate_readout and not exit_policy.needs_logits and not speculating
    if sync_passes is None:
        return AUTO_SYNC_PASSES if saves else 1
    if sync_passes == 1:
        return 1
    require(
        not speculating,
        "exit sync_passes > 1 cannot hold exits back under speculative decoding, whose "
        "lanes hold an exit while its token is a draft: use 1 or leave it unset",
        "sync_passes",
    )
    require(
        model.separate_readout,
        "exit sync_passes > 1 holds exits back to share the layers after the loop, and this "
        "model has none: use 1",
        "sync_passes",
    )
    require(
        not exit_policy.needs_logits,
        f"exit sync_passes > 1 saves nothing under the {type(exit_policy).__name__}, which "
        "reads every decode row's logits every loop: use 1",
        "sync_passes",
    )
    return sync_passes


def build_engine_core(
    model,
    tokenizer: Tokenizer | None,
    config: EngineConfig,
    tensor_parallel: TensorParallel | None = None,
    extra_eos_token_ids: frozenset[int] = frozenset(),
) -> EngineCore:
    """The engine core of a loaded model, built as `config` says (its model and tensor
    parallelism were applied by the loading). `config.usage_context` picks the scheduler
    defaults that its scheduler config leaves to the device; its `max_model_len` caps a
    request's prompt + output below the model's context length (its default); a core of
    its `disaggregate` hands requests to, or takes them from, other engine cores."""
    cache_config, exit_config = config.cache_config, config.exit_config
    execution_config, speculative_config = config.execution_config, config.speculative_config
    scheduler_config, scheduler_note = size_scheduler(
        config.scheduler_config, model.device, config.usage_context
    )
    cfg = model.config
    max_model_len = checked_max_model_len(
        config.model_config.max_model_len, cfg.max_position_embeddings
    )
    check_stages(model, cache_config, config.parallel_config.disaggregate is not None)
    num_lanes = 1
    if speculative_config is not None:
        num_lanes = lanes_per_request(
            cfg.num_loops, speculative_config.draft_loops, speculative_config.max_ahead
        )
        check_speculation(
            speculative_config, cfg.num_loops, cache_config, scheduler_config, num_lanes
        )
    exit_policy = make_exit_policy(exit_config, model)
    if speculative_config is not None:
        check_speculated_exits(model, exit_policy, exit_config.mode)
    sync_passes = exit_sync_passes(
        exit_config.sync_passes, model, exit_policy, speculative_config is not None
    )
    fp8_setting = (
        "quantization"
        if model.quantization == "fp8"
        else "kv_cache_dtype"
        if cache_config.kv_cache_dtype in ("fp8", "fp8_e4m3")  # e5m2 converts on older GPUs too
        else None
    )
    backend, ops = get_backend(
        config.device_config.attention_backend, model.device, cfg.head_dim, fp8_setting
    )
    # Made before the cache is sized, so the memory plan sees its buffers.
    lanes = None
    if speculative_config is not None:
        lanes = SpecLanes(
            scheduler_config.max_num_seqs,
            num_lanes,
            speculative_config.draft_loops,
            speculative_config.max_ahead,
            cfg.vocab_size,
            model.device,
            speculative_config.replay_acceptance_rate,
        )
    layout = cache_config.layout
    planes, table_planes = layout.planes(cfg.num_loops), layout.table_planes(cfg.num_loops)
    memory_plan = plan_memory(
        model,
        ops,
        cache_config,
        scheduler_config,
        execution_config,
        planes,
        table_planes,
        num_lanes,
        max_model_len,
    )
    if tensor_parallel is not None:  # every rank's scheduler must see the same pool
        fewest = tensor_parallel.min_over_ranks(memory_plan.num_blocks)
        memory_plan = dataclasses.replace(memory_plan, num_blocks=fewest)
    geometry = KVGeometry(
        planes=planes,
        block_size=cache_config.block_size,
        num_blocks=memory_plan.num_blocks,
        write_deeper_planes=layout.writes_deeper_planes,
        table_planes=table_planes,
    )
    kv = KVCacheManager(
        memory_plan.num_blocks,
        cache_config.block_size,
        enable_caching=cache_config.enable_prefix_caching,
    )
    # A cached block's K/V depends on the weights, the layout and the dtypes too.
    salt = repr(
        (
            vars(cfg),
            cache_config.layout,
            str(model.dtype),
            model.quantization,
            cache_config.kv_cache_dtype,
        )
    )
    scheduler = Scheduler(
        scheduler_config,
        kv,
        cfg.num_loops,
        one_position_prefill=layout.one_position_prefill,
        cache_salt=hashlib.sha256(salt.encode()).digest(),
        table_planes=table_planes,
        speculation=speculative_config,
        lanes_per_request=num_lanes,
        seeded_prefixes=model.draws_initial_state,
    )
    runner = ModelRunner(
        model,
        geometry,
        scheduler_config.max_num_seqs * num_lanes,
        max_model_len,
        exit_policy,
        ops,
        lanes,
        kv_cache_torch_dtype(cache_config.kv_cache_dtype, model.dtype),
        sync_passes,
    )
    runner.prepare_device(execution_config.cuda_graphs, scheduler_config.max_num_batched_tokens)
    checker = RequestChecker(
        RequestLimits(
            vocab_size=cfg.vocab_size,
            max_model_len=max_model_len,
            num_blocks=memory_plan.num_blocks,
            block_size=cache_config.block_size,
            num_loops=cfg.num_loops,
            scheduling_policy=scheduler_config.scheduling_policy,
            prompt_tables=table_planes,
        ),
        exit_config,
    )
    eos_token_ids = frozenset(cfg.eos_token_ids) | extra_eos_token_ids
    if tokenizer is not None:
        eos_token_ids |= tokenizer.eos_token_ids
    return EngineCore(
        model,
        tokenizer,
        max_model_len,
        eos_token_ids,
        scheduler,
        runner,
        checker,
        memory_plan,
        cache_config,
        execution_config,
        speculative_config,
        backend,
        scheduler_note,
        config.parallel_config.disaggregate is not None,
    )


def checked_max_model_len(asked: int | None, context: int) -> int:
    """vLLM's max_model_len: the model's context length, or a smaller cap."""
    if asked is None:
        return context
    require_int(asked, "max_model_len", 1, context)
    return asked
