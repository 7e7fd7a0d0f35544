"""Frozen engine configuration: cache, scheduler, exit policy and execution settings."""

from __future__ import annotations

import enum
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

MAX_NUM_SEQS = 65536
DEFAULT_ADMISSION_SCAN = 64  # waiting requests admission looks at per pass, when not sized
# Which entry point runs the engine: scheduler defaults differ (engine/device_defaults.py).
OFFLINE, SERVE = "offline", "serve"


class KVLayout(str, enum.Enum):
    """How the KV cache holds a looped model's loops (see CacheConfig), and the geometry
    each implies: every place that depends on the layout asks it here."""

    LAST_EXITED = "last_exited"
    SHARED = "shared"
    SHARED_DECODE = "shared_decode"

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)

    def planes(self, num_loops: int) -> int:
        """Cache planes: one per loop under last_exited, else one."""
        return num_loops if self is KVLayout.LAST_EXITED else 1

    def table_planes(self, num_loops: int) -> int:
        """Block-table rows per slot: one per loop under shared_decode (a prompt's per-loop
        tables), else one."""
        return num_loops if self is KVLayout.SHARED_DECODE else 1

    @property
    def writes_deeper_planes(self) -> bool:
        """A decode row also writes every deeper plane (last_exited)."""
        return self is KVLayout.LAST_EXITED

    @property
    def one_position_prefill(self) -> bool:
        """A prompt position runs every loop before the next starts (shared)."""
        return self is KVLayout.SHARED


KV_LAYOUTS = tuple(layout.value for layout in KVLayout)
USAGE_CONTEXTS = (OFFLINE, SERVE)
SCHEDULING_MODES = ("refill", "no_refill")
SCHEDULING_POLICIES = ("fcfs", "priority")
# The names users pick implementations by, each with its class as "module:name", imported
# only where it runs (the command line lists the names without loading torch). A new exit
# policy (exit/) or K/V connector (engine/disagg/) is its module and its line here.
EXIT_POLICY_CLASSES = {
    "ouro": "vllm_rlt.exit.ouro:OuroPolicy",
    "ouro_delayed": "vllm_rlt.exit.ouro_delayed:OuroDelayedPolicy",
    "random_lookahead": "vllm_rlt.exit.random_lookahead:RandomLookaheadPolicy",
    "trace": "vllm_rlt.exit.trace:TracePolicy",
    "latent_diff": "vllm_rlt.exit.latent_diff:LatentDiffPolicy",
    "kl": "vllm_rlt.exit.kl:KLPolicy",
    "entropy_diff": "vllm_rlt.exit.entropy_diff:EntropyDiffPolicy",
}
EXIT_MODES = ("auto", *EXIT_POLICY_CLASSES)  # auto: the model family's own
KV_CONNECTOR_CLASSES = {  # how `--disaggregate` moves K/V
    "torch": "vllm_rlt.engine.disagg.torch_connector:TorchConnector",
    "nixl": "vllm_rlt.engine.disagg.nixl_connector:NixlConnector",
}
KV_CONNECTORS = ("auto", *KV_CONNECTOR_CLASSES)  # auto: torch
QUANTIZATIONS = ("fp8",)  # weight quantization at load (vllm_rlt/layers/fp8.py)
# K/V storage: auto (the model's dtype) or float8 (fp8 and fp8_e4m3: e4m3, vLLM's names).
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")
# KV blocks on the CPU when no size is given; here, free of torch, for the help screens.
CPU_DEFAULT_BLOCKS = 256


class ParamError(ValueError):
    """A user-facing value is invalid; `param` names the field as the API spells it."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def cache_root() -> Path:
    """Where the engine keeps what it makes once per machine (built CUDA kernels, W8A8
    tables measured on the card): VLLM_RLT_CACHE_DIR, default ~/.cache/vllm-rlt."""
    return Path(os.environ.get("VLLM_RLT_CACHE_DIR") or Path.home() / ".cache" / "vllm-rlt")


def require(condition: bool, message: str, param: str | None = None) -> None:
    """Raise a ParamError (a ValueError) with `message` when a user-facing setting is invalid."""
    if not condition:
        raise ParamError(message, param)


def check_quantization(quantization: str | None) -> None:
    """ParamError naming the field and the values it may take."""
    require(
        quantization is None or quantization in QUANTIZATIONS,
        f"quantization must be one of {', '.join(QUANTIZATIONS)} or None (unquantized), "
        f"got {quantization!r}",
        "quantization",
    )


def shown_int(value: int) -> str:
    """`value` for a message, cut to its first 20 digits when longer: a caller may send
    thousands of digits, which say no more, and Python prints at most 4300."""
    magnitude = abs(value)
    if magnitude < 10**20:
        return str(value)
    beyond = max(0, int(magnitude.bit_length() * 0.30103) - 20)  # digits past the first 20
    return f"{'-' if value < 0 else ''}{str(magnitude // 10**beyond)[:20]}..."


# Python prints at most 4,300 digits of an int; no field's range comes near 4,000.
_OVERLONG_BITS = 13_300  # about 4,000 decimal digits


def require_printable_ints(
    name: str,
    value: Any,
    allowed: str | None = None,
    depth: int = 2,
    param: str | None = None,
    values_allowed: str | None = None,
) -> None:
    """ParamError where `value`, or an entry of its lists, tuples or dicts (`depth` levels
    down, as far as the token-id lists go), is an integer too long to print: every message
    about it would fail in Python's conversion instead of naming the field. `allowed`:
    what the field, its entries or its keys may be, for the message; `values_allowed`:
    what a dict's values may be."""
    param = param or name
    if isinstance(value, int) and value.bit_length() > _OVERLONG_BITS:
        digits = f"an integer of about {int(value.bit_length() * 0.30103):,} digits"
        what = "within every range a field allows" if allowed is None else allowed
        raise ParamError(f"{name} must be {what}, got {digits}", param)
    if depth == 0:
        return
    if isinstance(value, (list, tuple)):
        for index, entry in enumerate(value):
            require_printable_ints(f"{name}[{index}]", entry, allowed, depth - 1, param)
    elif isinstance(value, dict):
        for key, entry in value.items():
            require_printable_ints(f"{name} key", key, allowed, 0, param)
            require_printable_ints(f"{name} value", entry, values_allowed, depth - 1, param)


def require_int(
    value: Any, name: str, low: int, high: int | None = None, param: str | None = None
) -> None:
    """Check that `value` is an int in [low, high] (no upper bound where high is None); the
    message names the field and the range."""
    allowed = f">= {low}" if high is None else f"in [{low}, {high}]"
    field = name if param is None else param
    if not isinstance(value, int) or isinstance(value, bool):
        raise ParamError(f"{name} must be an integer {allowed}, got {value!r}", field)
    if value < low or (high is not None and value > high):
        raise ParamError(f"{name} must be {allowed}, got {shown_int(value)}", field)


def require_valid_text(text: str, field: str) -> None:
    """Text that cannot be UTF-8 encoded (a lone surrogate, which JSON and the command line
    can carry) is a user error, not a tokenizer failure."""
    require(isinstance(text, str), f"{field} must be a string, got {type(text).__name__}", field)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ParamError(
            f"{field} is not valid Unicode: character {exc.start} is a lone surrogate "
            f"(U+{ord(text[exc.start]):04X})",
            field,
        ) from None


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache settings.

    `layout` is "last_exited" (one plane per loop; an earlier token is read at min(loop, its
    exit depth)), "shared" (one plane overwritten every loop) or "shared_decode" (a prompt
    keeps one plane per loop while it prefills, then only its final plane; decode tokens
    share one plane). A block holds `block_size` positions of every plane under
    last_exited, of one plane otherwise. `num_blocks=None` sizes the
    pool automatically; `kv_cache_memory_bytes` sizes it from a byte budget instead.
    `kv_cache_dtype` "fp8" (or "fp8_e4m3") stores K and V as float8 e4m3, "fp8_e5m2" as
    e5m2, with scale 1 as vLLM uses without calibrated scales: half the bytes of bf16 per
    position; attention widens them as it reads. "auto" keeps the model's dtype.
    `enable_prefix_caching` shares the K/V of full prompt blocks between requests whose
    prompts start alike (prompt positions run every loop, so this is exact in every exit
    mode). Under shared_decode, which frees a prompt's per-loop planes once the prompt is
    done (a later prompt would need them to continue from the prefix), the cache holds
    only final planes handed over by prefill cores (disaggregation), and serves imports.
    """

    layout: KVLayout | str = KVLayout.LAST_EXITED  # a name is taken and kept as KVLayout
    block_size: int = 16
    num_blocks: int | None = None
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        require(
            self.layout in KV_LAYOUTS,
            f"layout must be one of {', '.join(KV_LAYOUTS)}, got {self.layout!r}",
        )
        require(
            self.kv_cache_dtype in KV_CACHE_DTYPES,
            f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
            f"got {self.kv_cache_dtype!r}",
            "kv_cache_dtype",
        )
        object.__setattr__(self, "layout", KVLayout(self.layout))
        require_int(self.block_size, "block_size", 1, 1024)
        if self.num_blocks is not None:
            require_int(self.num_blocks, "num_blocks", 1)
        if self.kv_cache_memory_bytes is not None:
            require_int(self.kv_cache_memory_bytes, "kv_cache_memory_bytes", 1)
        require(
            self.num_blocks is None or self.kv_cache_memory_bytes is None,
            "num_blocks and kv_cache_memory_bytes are mutually exclusive",
        )
        require(
            isinstance(self.gpu_memory_utilization, (int, float))
            and not isinstance(self.gpu_memory_utilization, bool)
            and 0.0 < self.gpu_memory_utilization <= 1.0,
            f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}",
        )


@dataclass(frozen=True)
class SchedulerConfig:
    """Loop-level continuous batching settings.

    `mode="refill"` starts a request's next token as soon as its previous one exits;
    `"no_refill"` lets the decode cohort start its next tokens only once every running token
    has exited. `max_num_batched_tokens` bounds the rows of one pass. A prompt is prefilled in
    chunks of at most `prefill_chunk_size` positions, each running all loops;
    `max_prefill_batches_before_decode` bounds how many prefill chunks may be in flight at once,
    so decode rows keep most of every pass. Admission scans at most `admission_scan_limit`
    waiting requests, and a request that cannot be admitted is passed by later ones at most
    `max_admission_bypasses` times before admission waits for it. `scheduling_policy`
    "fcfs" serves requests in arrival order; "priority" by `SamplingParams.priority` (lower
    first), then arrival, and preempts running requests of a higher value for a waiting one.

    `max_num_seqs`, `max_num_batched_tokens`, `max_prefill_batches_before_decode` and
    `admission_scan_limit` left at None are sized to the device when the engine starts
    (`engine/device_defaults.py`): small on the CPU, large on a big GPU, and for a server
    other than for offline batches.
    """

    mode: str = "refill"
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    prefill_chunk_size: int = 512
    max_prefill_batches_before_decode: int | None = None
    admission_scan_limit: int | None = None
    max_admission_bypasses: int = 8
    scheduling_policy: str = "fcfs"

    def __post_init__(self) -> None:
        require(
            self.scheduling_policy in SCHEDULING_POLICIES,
            f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}, got "
            f"{self.scheduling_policy!r}",
            "scheduling_policy",
        )
        require(
            self.mode in SCHEDULING_MODES,
            f"mode must be one of {', '.join(SCHEDULING_MODES)}, got {self.mode!r}",
        )
        if self.max_num_seqs is not None:
            require_int(self.max_num_seqs, "max_num_seqs", 1, MAX_NUM_SEQS)
        if self.max_num_batched_tokens is not None:
            require_int(self.max_num_batched_tokens, "max_num_batched_tokens", 1)
        require_int(self.prefill_chunk_size, "prefill_chunk_size", 1)
        if self.max_prefill_batches_before_decode is not None:
            require_int(
                self.max_prefill_batches_before_decode, "max_prefill_batches_before_decode", 1
            )
        if self.admission_scan_limit is not None:
            require_int(self.admission_scan_limit, "admission_scan_limit", 1)
        require_int(self.max_admission_bypasses, "max_admission_bypasses", 0)
        if self.max_num_seqs is not None and self.max_num_batched_tokens is not None:
            require(
                self.max_num_batched_tokens >= self.max_num_seqs,
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                f"max_num_seqs ({self.max_num_seqs}) so every running request gets a row",
            )

    @property
    def admission_scan(self) -> int:
        """Waiting requests admission looks at per pass (DEFAULT_ADMISSION_SCAN unless set
        or sized)."""
        if self.admission_scan_limit is None:
            return DEFAULT_ADMISSION_SCAN
        return self.admission_scan_limit

    @property
    def is_sized(self) -> bool:
        """Whether every field the scheduler needs sized has a value (the admission scan
        falls back to DEFAULT_ADMISSION_SCAN)."""
        return None not in (
            self.max_num_seqs,
            self.max_num_batched_tokens,
            self.max_prefill_batches_before_decode,
        )


# Passes a token may wait to exit with others (ExitConfig.sync_passes).
MAX_SYNC_PASSES = 256
# What sync_passes None gives where holding exits back saves streaming: 2 lets the layers
# after the loop stream in about half the passes (Huginn-3.5B at 64 rows and a mean depth of
# 16 of 32 under steady load: 1.10x the decode throughput of 1; 3 adds 3% more for a
# longer hold).
AUTO_SYNC_PASSES = 2


@dataclass(frozen=True)
class ExitConfig:
    """Exit policy for decode tokens (prefill always runs every loop).

    `mode`: "auto" (the model family's own: "ouro" for Ouro and Nanbeige, "latent_diff" for
    Huginn), "ouro" (the checkpoint's gate, immediate), "ouro_delayed" (a trigger after loop r
    exits after loop r+1), "random_lookahead" (a frozen head seeded with `seed`, read as "exit
    after one more loop"), "trace" (replay `depths_by_request`: the prefill depth T first,
    then one depth per decode input), "latent_diff" (the relative change of the state
    between checks below the request's exit_threshold), "kl" (the KL divergence between
    successive checks' next-token distributions below it) or "entropy_diff" (the change of
    the next-token entropy between checks below it).

    `sync_passes` (models with layers after the loop, such as Huginn's coda): a token whose
    policy says exit waits, frozen, for up to sync_passes - 1 passes until the other decode
    rows exit too, so those layers and the LM head stream their weights once for all of
    them; the tokens and exit depths are those of exiting at once (worker/exit_sync.py).
    1: every token exits at once. None (the default): AUTO_SYNC_PASSES where the model has
    such layers and the policy does not read every row's logits every loop, else 1.
    """

    mode: str = "auto"
    seed: int = 0
    depths_by_request: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    sync_passes: int | None = None

    def __post_init__(self) -> None:
        require(
            self.mode in EXIT_MODES,
            f"exit mode must be one of {', '.join(EXIT_MODES)}, got {self.mode!r}",
        )
        require_int(self.seed, "seed", 0, 2**63 - 1)
        if self.sync_passes is not None:
            require_int(self.sync_passes, "sync_passes", 1, MAX_SYNC_PASSES)
        frozen = {}
        for request_id, depths in dict(self.depths_by_request).items():
            require(
                isinstance(depths, (list, tuple)) and len(depths) > 0,
                f"depths_by_request[{request_id!r}] must be a non-empty list of loop depths",
            )
            for depth in depths:
                require_int(depth, f"depths_by_request[{request_id!r}] entry", 1)
            frozen[str(request_id)] = tuple(depths)
        object.__setattr__(self, "depths_by_request", MappingProxyType(frozen))
        require(
            self.mode == "trace" or not frozen,
            "depths_by_request is only used with exit mode 'trace'",
        )

    def __reduce__(self):
        """Picklable (the engine-core process receives it) although the mapping is a
        read-only proxy."""
        return (
            ExitConfig,
            (self.mode, self.seed, dict(self.depths_by_request), self.sync_passes),
        )


MAX_SPECULATIVE_TOKENS = 16
# `num_speculative_tokens="auto"` drafts only while at most this many requests run: on an
# H200 (Ouro-1.4B shape, bf16, two-loop drafts, 80% acceptance) speculation gained 1.09x
# at 64 requests decoding at once and lost at 128 (docs/benchmarks).
AUTO_DISABLE_BY_BATCH_SIZE = 64


@dataclass(frozen=True)
class SpeculativeConfig:
    """Self-speculative decoding: the model's first `draft_loops` loops draft the next
    token while the remaining loops verify the previous one, in the same passes (see
    docs/structure.md). It applies to requests whose max_loops exceeds the draft's, at any
    exit rule, without logit adjustments; others decode as usual.

    `num_speculative_tokens` caps the draft tokens a request runs ahead of its last
    verified one; more than ceil(depth / draft_loops) - 1 never run, since a draft is
    verified by the time that many more are made. "auto" takes that many and sets
    `disable_by_batch_size` to AUTO_DISABLE_BY_BATCH_SIZE unless it is given.
    `disable_by_batch_size`: while more requests than this run, lanes do not draft and
    each speculating request decodes as a plain row from its next refused or undrafted
    token on (speculation costs rows, and pays only at low load).

    `replay_acceptance_rate` is for benchmarks only: each draft token is accepted with this
    probability instead of being checked, so random weights cost what a model with that
    acceptance would (the outputs are then not the model's)."""

    num_speculative_tokens: int | str = 2
    draft_loops: int = 2
    replay_acceptance_rate: float | None = None
    disable_by_batch_size: int | None = None

    def __post_init__(self) -> None:
        tokens = self.num_speculative_tokens
        require(
            not isinstance(tokens, str) or tokens == "auto",
            f"num_speculative_tokens must be 'auto' or an integer in [1, "
            f"{MAX_SPECULATIVE_TOKENS}], got {tokens!r}",
            "num_speculative_tokens",
        )
        if tokens != "auto":
            require_int(
                self.num_speculative_tokens,
                "num_speculative_tokens",
                1,
                MAX_SPECULATIVE_TOKENS,
            )
        require_int(self.draft_loops, "draft_loops", 1)
        rate = self.replay_acceptance_rate
        require(
            rate is None
            or (isinstance(rate, (int, float)) and not isinstance(rate, bool) and 0 <= rate <= 1),
            f"replay_acceptance_rate must be in [0, 1], got {rate!r}",
            "replay_acceptance_rate",
        )
        if self.disable_by_batch_size is not None:
            require_int(self.disable_by_batch_size, "disable_by_batch_size", 1)

    @property
    def max_ahead(self) -> int:
        """The cap on drafts ahead of the verified token ("auto": none below the pipeline's)."""
        tokens = self.num_speculative_tokens
        return MAX_SPECULATIVE_TOKENS if tokens == "auto" else int(tokens)

    @property
    def batch_limit(self) -> int | None:
        """Requests running at admission from which a request decodes without speculation."""
        if self.disable_by_batch_size is None and self.num_speculative_tokens == "auto":
            return AUTO_DISABLE_BY_BATCH_SIZE
        return self.disable_by_batch_size


@dataclass(frozen=True)
class ExecutionConfig:
    """How passes are executed.

    `cuda_graphs`: replay decode-only passes as CUDA graphs (CUDA with the triton backend;
    ignored elsewhere). `async_scheduling`: plan and launch pass k+1 before reading pass k's
    results (refill mode; no_refill runs synchronously); the default, since it won at every
    measured concurrency (docs/benchmarks/). `seed` seeds the per-request seeds of unseeded
    requests.
    """

    cuda_graphs: bool = True
    async_scheduling: bool = True
    seed: int = 0

    def __post_init__(self) -> None:
        require_int(self.seed, "seed", 0, 2**63 - 1)
