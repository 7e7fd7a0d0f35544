"""Engine command-line flags, defined once and shared by every subcommand and the server."""

from __future__ import annotations

import argparse
import json
from dataclasses import fields
from pathlib import Path
from typing import Any

from vllm_rlt.config import (
    AUTO_DISABLE_BY_BATCH_SIZE,
    CPU_DEFAULT_BLOCKS,
    EXIT_MODES,
    KV_CACHE_DTYPES,
    KV_LAYOUTS,
    MAX_SPECULATIVE_TOKENS,
    QUANTIZATIONS,
    SCHEDULING_MODES,
    SCHEDULING_POLICIES,
    CacheConfig,
    ExecutionConfig,
    ExitConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from vllm_rlt.engine.engine_args import EngineArgs
from vllm_rlt.engine_config import DeviceConfig, EngineConfig, ModelConfig, ParallelConfig


def config_default(config: type, name: str) -> Any:
    """A config field's default, as its flag's default: defaults live in the configs."""
    return next(f.default for f in fields(config) if f.name == name)


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Model, cache, scheduler, exit and execution flags."""
    _add_model_args(parser)
    _add_cache_args(parser)
    _add_scheduler_args(parser)
    _add_exit_args(parser)
    _add_execution_args(parser)
    add_speculation_args(parser)


def _add_model_args(parser: argparse.ArgumentParser) -> None:
    """The model and where it runs."""
    model = parser.add_argument_group("model")
    model.add_argument(
        "--model",
        default=None,
        help="HF checkpoint folder, hub ID (owner/name, fetched into the hub's cache), or "
        "built-in ouro-tasks (default) / huginn-tasks / toy (random weights)",
    )
    model.add_argument(
        "--tokenizer", default=None, help="tokenizer folder or hub ID (default: the model's)"
    )
    model.add_argument(
        "--revision", default=None, help="hub revision of a hub-ID model (default: main)"
    )
    model.add_argument(
        "--download-dir",
        default=None,
        help="hub cache folder for hub IDs (default: the hub's, under HF_HOME)",
    )
    model.add_argument(
        "--skip-tokenizer-init",
        action="store_true",
        help="load no tokenizer: token-id prompts only, outputs without text",
    )
    model.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="cap on prompt + output tokens (default: the model's context length)",
    )
    model.add_argument(
        "--generation-config",
        default=config_default(ModelConfig, "generation_config"),
        help="sampling defaults for unset request fields: auto (the model's "
        "generation_config.json), vllm (the engine's) or a folder",
    )
    model.add_argument(
        "--generation-config-ignore-invalid",
        action="store_true",
        help="leave unset, with a warning, a sampling default in generation_config.json "
        "that no request could send (temperature -1, top_p 2, NaN), instead of refusing to "
        "start (default: refuse)",
    )
    model.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="accepted for vLLM's command lines; changes nothing (no checkpoint code runs)",
    )
    model.add_argument(
        "--device", default=config_default(DeviceConfig, "device"), help="cpu or cuda[:N]"
    )
    model.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=config_default(ParallelConfig, "tensor_parallel_size"),
        help="processes (GPUs: cuda:0 .. cuda:N-1) that split every layer's heads and MLP "
        "features; N must divide the heads, the KV heads and the MLP width",
    )
    model.add_argument(
        "--dtype",
        default=config_default(ModelConfig, "dtype"),
        help="auto, float32, bfloat16 or float16 (auto: bf16 on CUDA)",
    )
    model.add_argument(
        "--attention-backend",
        default=config_default(DeviceConfig, "attention_backend"),
        help="auto (triton on CUDA), triton or torch",
    )
    model.add_argument(
        "--quantization",
        choices=QUANTIZATIONS,
        default=None,
        help="fp8: every layer's projections held in float8 e4m3 with one scale per output "
        "channel, quantized at load (half their bytes; the embedding, LM head, exit gate "
        "and norms keep --dtype); an FP8 checkpoint loads as such without it (default: none)",
    )
    model.add_argument(
        "--seed",
        type=int,
        default=config_default(ExecutionConfig, "seed"),
        help="engine seed: unseeded requests draw their seeds from it",
    )


def _add_cache_args(parser: argparse.ArgumentParser) -> None:
    """The KV cache."""
    cache = parser.add_argument_group("KV cache")
    cache.add_argument(
        "--kv-layout",
        choices=KV_LAYOUTS,
        default=str(config_default(CacheConfig, "layout")),
        help="last_exited: one plane per loop (exact); shared: one plane for every loop, "
        "prefill included (a quarter of the memory, different numerics); shared_decode: "
        "one plane per loop while a prompt prefills, then one plane per position (the "
        "prompt computes as under last_exited; decode shares, as the Ouro report "
        "validates; its prefix cache serves only K/V handed over from prefill cores)",
    )
    cache.add_argument(
        "--block-size",
        type=int,
        default=config_default(CacheConfig, "block_size"),
        help="positions per KV block",
    )
    cache.add_argument(
        "--kv-cache-dtype",
        choices=KV_CACHE_DTYPES,
        default=config_default(CacheConfig, "kv_cache_dtype"),
        help="K/V storage: auto (the model's dtype), fp8 or fp8_e4m3 (float8 e4m3), fp8_e5m2; "
        "float8 holds twice the positions of bf16 in the same memory, divided by an FP8 "
        "checkpoint's K/V scales where it has them, else at scale 1 (as vLLM)",
    )
    cache.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=config_default(CacheConfig, "enable_prefix_caching"),
        help="share the K/V of full prompt blocks between requests whose prompts start "
        "alike (exact: prompt positions run every loop; under shared_decode only K/V handed "
        "over from prefill cores)",
    )
    sizing = cache.add_mutually_exclusive_group()
    sizing.add_argument(
        "--num-blocks",
        type=int,
        default=None,
        help="KV blocks in the pool (default: sized from device memory on CUDA, "
        f"else {CPU_DEFAULT_BLOCKS}, times the loops under shared_decode, whose blocks hold "
        "one plane)",
    )
    sizing.add_argument(
        "--kv-cache-memory-bytes",
        type=int,
        default=None,
        help="size the KV pool from this many bytes instead (default: unset)",
    )
    cache.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=config_default(CacheConfig, "gpu_memory_utilization"),
        help="fraction of device memory the engine may use (CUDA)",
    )


def _add_scheduler_args(parser: argparse.ArgumentParser) -> None:
    """The scheduler."""
    sched = parser.add_argument_group("scheduler")
    sched.add_argument(
        "--mode",
        choices=SCHEDULING_MODES,
        default=config_default(SchedulerConfig, "mode"),
        help="refill: a row freed by an exit is refilled at once; no_refill: the decode "
        "cohort waits for its slowest token",
    )
    sched.add_argument(
        "--scheduling-policy",
        choices=SCHEDULING_POLICIES,
        default=config_default(SchedulerConfig, "scheduling_policy"),
        help="fcfs: arrival order; priority: each request's priority (lower first), and "
        "running requests of a higher value are preempted for a waiting one",
    )

    def sized(cpu: int) -> str:
        return f"default: sized to the device and logged at start-up; {cpu} on the CPU"

    sched.add_argument(
        "--max-num-seqs", type=int, default=None, help=f"requests running at once ({sized(64)})"
    )
    sched.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help=f"rows of one pass at most ({sized(2048)})",
    )
    sched.add_argument(
        "--prefill-chunk-size",
        type=int,
        default=config_default(SchedulerConfig, "prefill_chunk_size"),
        help="prompt positions per prefill chunk",
    )
    sched.add_argument(
        "--max-prefill-batches-before-decode",
        type=int,
        default=None,
        help=f"prefill chunks in flight at once ({sized(4)})",
    )
    sched.add_argument(
        "--admission-scan-limit",
        type=int,
        default=None,
        help=f"waiting requests scanned per pass ({sized(64)})",
    )
    sched.add_argument(
        "--max-admission-bypasses",
        type=int,
        default=config_default(SchedulerConfig, "max_admission_bypasses"),
        help="times a request that does not fit may be passed by later ones",
    )


def _add_exit_args(parser: argparse.ArgumentParser) -> None:
    """The exit policy."""
    exits = parser.add_argument_group("exit policy")
    exits.add_argument(
        "--exit-mode",
        choices=EXIT_MODES,
        default=config_default(ExitConfig, "mode"),
        help="auto: the model family's own (ouro; latent_diff for Huginn); ouro: the "
        "checkpoint's exit gate; ouro_delayed: exit one loop after it fires; random_lookahead: "
        "a seeded random head (experiments); trace: replay --exit-trace; latent_diff: the "
        "state's relative change below exit_threshold; kl: the KL divergence between "
        "successive loops' next-token distributions below exit_threshold; entropy_diff: the "
        "next-token entropy's change below exit_threshold",
    )
    exits.add_argument(
        "--exit-trace",
        type=Path,
        default=None,
        metavar="FILE",
        help='JSON file: {"request_id": [T, d1, d2, ...]} or a list of depth lists by prompt '
        "(trace mode only; default: none)",
    )
    exits.add_argument(
        "--exit-sync-passes",
        type=int,
        default=config_default(ExitConfig, "sync_passes"),
        help="models with layers after the loop (Huginn): a token that decides to exit may "
        "wait up to N-1 passes for others, so the coda and LM head run once for all of them "
        "(same tokens and depths); 1: exit at once (default: 2 for such models under an exit "
        "policy that does not read every row's logits each loop, else 1)",
    )
    exits.add_argument(
        "--lookahead-seed",
        type=int,
        default=config_default(ExitConfig, "seed"),
        help="seed of the random_lookahead head",
    )


def _add_execution_args(parser: argparse.ArgumentParser) -> None:
    """How passes run."""
    execution = parser.add_argument_group("execution")
    execution.add_argument(
        "--enforce-eager", action="store_true", help="do not replay decode passes as CUDA graphs"
    )
    execution.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=config_default(ExecutionConfig, "async_scheduling"),
        help="plan and launch the next pass while the device runs the current one",
    )


def _speculative_tokens(value: str) -> int | str:
    if value == "auto":
        return value
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"must be 'auto' or an integer in [1, {MAX_SPECULATIVE_TOKENS}], got {value!r}"
        ) from None


def add_speculation_args(parser: argparse.ArgumentParser, replay: bool = False) -> None:
    """Self-speculation flags; `replay` adds the benchmarks' replayed acceptance."""
    spec = parser.add_argument_group("self-speculative decoding")
    spec.add_argument(
        "--speculative-tokens",
        type=_speculative_tokens,
        default=None,
        help="draft tokens a request may run ahead of its last verified one, drafted by the "
        "first --draft-loops loops and verified by the rest in the same passes (requests "
        "without logit adjustments, at any exit rule); 'auto': as many as the pipeline uses, and "
        f"drafting only while at most {AUTO_DISABLE_BY_BATCH_SIZE} requests run (default: off)",
    )
    spec.add_argument(
        "--draft-loops",
        type=int,
        default=config_default(SpeculativeConfig, "draft_loops"),
        help="loops a draft token runs (with --speculative-tokens)",
    )
    spec.add_argument(
        "--speculative-disable-by-batch-size",
        type=int,
        default=None,
        help="while more requests than this run, lanes stop drafting and speculating "
        "requests decode as plain rows (default: none; with 'auto', "
        f"{AUTO_DISABLE_BY_BATCH_SIZE})",
    )
    if replay:
        spec.add_argument(
            "--spec-acceptance-rate",
            type=float,
            default=None,
            help="accept each draft token with this probability instead of checking it, so "
            "random weights cost what that acceptance would (default: check)",
        )


def speculative_config(ns: argparse.Namespace) -> SpeculativeConfig | None:
    """The flags of `add_speculation_args` as a config (None: speculation off)."""
    if ns.speculative_tokens is None:
        return None
    return SpeculativeConfig(
        num_speculative_tokens=ns.speculative_tokens,
        draft_loops=ns.draft_loops,
        replay_acceptance_rate=getattr(ns, "spec_acceptance_rate", None),
        disable_by_batch_size=ns.speculative_disable_by_batch_size,
    )


def read_exit_trace(path: Path) -> dict[str, tuple[int, ...]]:
    """Load a trace file: a mapping request_id -> depths, or a list indexed by prompt."""
    try:
        raw = json.loads(path.read_text())
    except OSError as exc:
        raise ValueError(f"--exit-trace: cannot read {path}: {exc.strerror}") from exc
    except json.JSONDecodeError as exc:
        raise ValueError(f"--exit-trace: {path} is not valid JSON: {exc}") from exc
    if isinstance(raw, list):
        raw = {str(index): depths for index, depths in enumerate(raw)}
    if not isinstance(raw, dict):
        raise ValueError(f"--exit-trace: {path} must hold an object or a list of depth lists")
    return {
        str(key): tuple(value) if isinstance(value, list) else value for key, value in raw.items()
    }


def engine_args_from(ns: argparse.Namespace, **serving: Any) -> EngineArgs:
    """The flags as `EngineArgs` (a bad value raises ValueError naming it); `serving`:
    fields only the server's flags give (usage context, data parallelism,
    disaggregation)."""
    if ns.exit_trace is not None and ns.exit_mode != "trace":
        raise ValueError("--exit-trace needs --exit-mode trace")
    if ns.exit_mode == "trace" and ns.exit_trace is None:
        raise ValueError("--exit-mode trace needs --exit-trace FILE")
    depths = read_exit_trace(ns.exit_trace) if ns.exit_trace is not None else {}
    return EngineArgs(
        model=ns.model,
        revision=ns.revision,
        download_dir=ns.download_dir,
        tokenizer=ns.tokenizer,
        skip_tokenizer_init=ns.skip_tokenizer_init,
        max_model_len=ns.max_model_len,
        generation_config=ns.generation_config,
        generation_config_ignore_invalid=ns.generation_config_ignore_invalid,
        device=ns.device,
        dtype=ns.dtype,
        attention_backend=ns.attention_backend,
        quantization=ns.quantization,
        tensor_parallel_size=ns.tensor_parallel_size,
        cache_config=CacheConfig(
            layout=ns.kv_layout,
            enable_prefix_caching=ns.enable_prefix_caching,
            block_size=ns.block_size,
            kv_cache_dtype=ns.kv_cache_dtype,
            num_blocks=ns.num_blocks,
            kv_cache_memory_bytes=ns.kv_cache_memory_bytes,
            gpu_memory_utilization=ns.gpu_memory_utilization,
        ),
        scheduler_config=SchedulerConfig(
            mode=ns.mode,
            max_num_seqs=ns.max_num_seqs,
            max_num_batched_tokens=ns.max_num_batched_tokens,
            prefill_chunk_size=ns.prefill_chunk_size,
            max_prefill_batches_before_decode=ns.max_prefill_batches_before_decode,
            admission_scan_limit=ns.admission_scan_limit,
            max_admission_bypasses=ns.max_admission_bypasses,
            scheduling_policy=ns.scheduling_policy,
        ),
        exit_config=ExitConfig(
            mode=ns.exit_mode,
            seed=ns.lookahead_seed,
            depths_by_request=depths,
            sync_passes=ns.exit_sync_passes,
        ),
        execution_config=ExecutionConfig(
            cuda_graphs=not ns.enforce_eager, async_scheduling=ns.async_scheduling, seed=ns.seed
        ),
        speculative_config=speculative_config(ns),
        **serving,
    )


def engine_config_or_exit(
    parser: argparse.ArgumentParser, ns: argparse.Namespace, **serving: Any
) -> EngineConfig:
    """`engine_args_from(ns, **serving).create_engine_config()` with the model checked to
    load: a bad flag, or a model that cannot be had (no such folder; a hub ID offline, not
    cached or unreachable), is `parser`'s one-line error and exit code 2, before anything
    loads."""
    try:
        config = engine_args_from(ns, **serving).create_engine_config()
        from vllm_rlt.models.load import check_model_source  # torch: once the hub has answered

        model_config = config.model_config
        check_model_source(
            model_config.model,
            config.device_config.device,
            model_config.dtype,
            model_config.generation_config,
            model_config.generation_config_ignore_invalid,
        )
    except (ValueError, OSError) as exc:
        parser.error(str(exc))
    return config
