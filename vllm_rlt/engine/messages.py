"""What crosses between the frontend and the engine-core process: msgspec structs encoded
as msgpack. Commands flow in (add, abort, control calls); one `EngineOutputs` flows out per
step with the new tokens of every request that progressed, never text, never pickle."""

from __future__ import annotations

import itertools
from typing import Any

import msgspec

from vllm_rlt.engine.kv_transport import KVPoolHandle
from vllm_rlt.sampling_params import SamplingParams
from vllm_rlt.worker.kv_pool import KVBlocks

# ----------------------------------------------------------------- frontend -> core


class AddRequest(msgspec.Struct, tag="add", array_like=True):
    """`client`: which frontend sent it (its outputs go back to that one alone).
    `handover`: run it to its first tokens, then offer it (`KVOffer`) for a decode core."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    client: int = 0
    handover: bool = False


class HandedCompletionMessage(msgspec.Struct, array_like=True):
    """engine/kv_handover.HandedCompletion."""

    index: int
    seed: int
    output_token_ids: list[int]
    exit_depths: list[int]
    logprobs: list[float]
    ranks: list[int]
    top_logprobs: list[list[tuple[int, float]]]
    finish_reason: str | None
    kv: KVBlocks | None


class KVOffer(msgspec.Struct, array_like=True):
    """A request a prefill core ran to its first tokens (engine/kv_handover.KVHandover),
    its K/V in blocks of the pool `pools` opens (a handle per tensor-parallel rank)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    completions: list[HandedCompletionMessage]
    pools: list[KVPoolHandle]


class KVPrefetch(msgspec.Struct, array_like=True):
    """Whole prompt blocks a prefill core finished while later chunks of the same prompt
    still run: blocks [first_block, first_block + len(blocks)) of its table, in the pool
    `pools` opens (as for `KVOffer`), holding positions of `prompt_token_ids` (the prompt
    up to their end)."""

    request_id: str
    prompt_token_ids: list[int]
    first_block: int
    blocks: list[int]
    pools: list[KVPoolHandle]


class PrefetchKV(msgspec.Struct, tag="prefetch", array_like=True):
    """Copy `prefetch`'s blocks into this (decode) core's prefix cache now, so that the
    request's import later copies only what came after; `client` hears when it is done."""

    prefetch: KVPrefetch
    client: int = 0


class ImportRequest(msgspec.Struct, tag="import", array_like=True):
    """Continue `offer` on this (decode) core; its outputs go to `client`."""

    offer: KVOffer
    client: int = 0


class ReleaseHandover(msgspec.Struct, tag="release", array_like=True):
    """The decode core has its copy of this request's K/V (or never will): free its blocks."""

    request_id: str


class ForgetKVPool(msgspec.Struct, tag="forget_pool", array_like=True):
    """A prefill core is gone: let go of its pool, mapped or read through NIXL, once the
    imports still queued from it are done with it."""

    pool_id: str


class AbortRequest(msgspec.Struct, tag="abort", array_like=True):
    """Abort a request, or only its completion `index`."""

    request_id: str
    index: int | None = None


class AbortAll(msgspec.Struct, tag="abort_all", array_like=True):
    """Abort every request of frontend `client`."""

    client: int = 0


Command = (
    AddRequest
    | AbortRequest
    | AbortAll
    | ImportRequest
    | PrefetchKV
    | ReleaseHandover
    | ForgetKVPool
)


# The parts of a sleeping engine that wake separately (vLLM's wake-up tags).
WAKE_TAGS = ("weights", "kv_cache")


class ControlCall(msgspec.Struct, tag="call", array_like=True):
    """A call on the control socket, answered by a `ControlReply` with the same `call_id`:
    "stats", "shutdown", or one of sleep mode's ("sleep_1", "sleep_2", "wake_up" or
    "wake_up:TAG,TAG" with vLLM's tags "weights" and "kv_cache",
    "is_sleeping", "reset_prefix_cache")."""

    call_id: int
    name: str


# ----------------------------------------------------------------- core -> frontend


class EngineInfo(msgspec.Struct, array_like=True):
    """The startup handshake: what the frontend needs to validate and shape requests."""

    model_name: str
    device: str
    num_loops: int
    vocab_size: int
    max_model_len: int
    num_blocks: int
    block_size: int
    max_num_seqs: int
    scheduling_policy: str = "fcfs"
    prompt_tables: int = 1  # block tables a prefilling prompt holds (RequestLimits)
    scheduler_note: str = ""  # how the scheduler was sized, for the server's start-up log
    eos_token_ids: list[int] = []  # the core's: the tokenizer's and those the model adds


class Ready(msgspec.Struct, tag="ready", array_like=True):
    info: EngineInfo


class StartupFailed(msgspec.Struct, tag="startup_failed", array_like=True):
    """`kind` is "invalid" (a bad argument: the message says it all), "os" (a file or
    device problem) or "internal" (with its traceback)."""

    kind: str
    message: str
    traceback: str = ""


class CompletionDelta(msgspec.Struct, array_like=True):
    """What one completion produced since the previous message: tokens `start` onwards.
    `stop_token`: with finish reason "stop", the stop id (not EOS) that ended it."""

    index: int
    start: int
    token_ids: list[int]
    exit_depths: list[int]
    logprobs: list[float] | None  # the sampled tokens' logprobs, when asked for
    top_logprobs: list[list[tuple[int, float]]] | None
    finish_reason: str | None
    ranks: list[int] | None = None  # the sampled tokens' ranks, with their logprobs
    stop_token: int | None = None


class RequestDelta(msgspec.Struct, array_like=True):
    """One request's progress in a step. `finished`: the core holds nothing of it any more.
    `error` says why the core failed it alone (`invalid`: a bad request, else internal)."""

    request_id: str
    completions: list[CompletionDelta]
    finished: bool
    error: str | None = None
    error_param: str | None = None
    invalid: bool = False
    # Sent once, in the first delta after the whole prompt was computed: per prompt position
    # from the second, the token's logprob, its rank and the top (id, logprob) alternatives.
    prompt_logprobs: list[tuple[float, int, list[tuple[int, float]]]] | None = None
    num_cached_tokens: int | None = None  # the first completion's, once admitted


class EngineStats(msgspec.Struct, array_like=True):
    """Counters the metrics read; passes, rows and preemptions count since startup."""

    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_blocks: int
    num_passes: int
    num_rows: int
    num_preemptions: int = 0
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # of them, found there
    spec_num_drafts: int = 0  # draft tokens verified (each on its own)
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_position: list[int] = []  # accepted drafts made i + 1 ahead
    # Passes that replayed captured CUDA graphs; the other passes ran eagerly (no graphs, or
    # a pass the graphs do not take: prompt logprobs, too many rows or sampling prompts).
    num_decode_graph_passes: int = 0
    num_prompt_graph_passes: int = 0

    @classmethod
    def of(cls, scheduler, runner, num_passes: int, num_rows: int) -> EngineStats:
        """The counters of an engine core with this scheduler and runner."""
        return cls(
            num_running=len(scheduler.running),
            num_waiting=len(scheduler.waiting),
            num_free_blocks=scheduler.kv.num_free_blocks,
            num_blocks=scheduler.kv.num_blocks,
            num_passes=num_passes,
            num_rows=num_rows,
            num_preemptions=scheduler.num_preemptions,
            prefix_cache_queries=scheduler.prefix_queries,
            prefix_cache_hits=scheduler.prefix_hits,
            spec_num_drafts=scheduler.num_drafted,
            spec_num_draft_tokens=scheduler.num_drafted,
            spec_num_accepted_tokens=scheduler.num_accepted,
            spec_accepted_per_position=list(scheduler.accepted_at),
            num_decode_graph_passes=runner.num_decode_graph_passes,
            num_prompt_graph_passes=runner.num_prompt_graph_passes,
        )


class CoreStats(EngineStats):
    """A core's answer to the "stats" control call: its engine's counters and what only the
    core's loop knows. With several data-parallel cores the frontend answers their sum
    (`sum_core_stats`), each core's own in `per_core` (a lost core's as None)."""

    num_requests: int = 0
    num_free_slots: int = 0
    num_cached_blocks: int = 0
    has_unfinished: bool = False
    all_blocks_free: bool = True
    passes_per_second: float = 0.0
    rows_per_pass: float = 0.0  # mean over the passes of the last few seconds
    per_core: list[CoreStats | None] = []  # filled by the frontend only


def sum_core_stats(values: list[CoreStats]) -> CoreStats:
    """Counters and gauges add up, flags combine, rows per pass is the mean over every
    core's passes, and accepted drafts add up position by position."""
    total: dict[str, Any] = {}
    for name in CoreStats.__struct_fields__:
        column = [getattr(value, name) for value in values]
        if name == "has_unfinished":
            total[name] = any(column)
        elif name == "all_blocks_free":
            total[name] = all(column)
        elif name == "spec_accepted_per_position":
            total[name] = [sum(counts) for counts in itertools.zip_longest(*column, fillvalue=0)]
        elif name not in ("rows_per_pass", "per_core"):
            total[name] = sum(column)
    rows = sum(value.rows_per_pass * value.passes_per_second for value in values)
    total["rows_per_pass"] = rows / total["passes_per_second"] if rows else 0.0
    return CoreStats(**total)


class EngineOutputs(msgspec.Struct, tag="outputs", array_like=True):
    """A step's deltas and counters; a prefill core's requests ready for a decode core
    (`offers`) and prompt blocks finished early (`prefetches`); a decode core's imports
    (`imported`) and prefetches (`prefetched`, one id per prefetch) whose source blocks may
    go."""

    requests: list[RequestDelta]
    stats: EngineStats
    offers: list[KVOffer] = []
    imported: list[str] = []
    prefetches: list[KVPrefetch] = []
    prefetched: list[str] = []


class ControlReply(msgspec.Struct, tag="reply", array_like=True):
    call_id: int
    value: CoreStats | dict[str, bool | str]  # "stats": CoreStats; else a small answer


class EngineDead(msgspec.Struct, tag="dead", array_like=True):
    """The core's last message: the error that stopped it."""

    message: str
    traceback: str


Message = Ready | StartupFailed | EngineOutputs | ControlReply | EngineDead


def command_codec() -> tuple[msgspec.msgpack.Encoder, msgspec.msgpack.Decoder]:
    return msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(Command)


def message_codec() -> tuple[msgspec.msgpack.Encoder, msgspec.msgpack.Decoder]:
    return msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(Message)
