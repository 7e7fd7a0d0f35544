"""What crosses between the frontend and the engine-core process: msgspec structs encoded
as msgpack. Commands flow in (add, abort, control calls); one `EngineOutputs` flows out per
step with the new tokens of every request that progressed, never text, never pickle."""

from __future__ import annotations

import msgspec

from vllm_rlt.engine.core_outputs import CoreStats, EngineStats, RequestDelta
from vllm_rlt.engine.disagg.registry import KVPoolHandle
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
    """engine/disagg/handover.HandedCompletion."""

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
    """A request a prefill core ran to its first tokens (engine/disagg/handover.KVHandover),
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


class StopCore(msgspec.Struct, tag="stop", array_like=True):
    """Abort every request and stop. A command, not a control call: the core reads its
    commands also while it owes a call its answer (a trainer's rendezvous)."""


Command = (
    AddRequest
    | AbortRequest
    | AbortAll
    | StopCore
    | ImportRequest
    | PrefetchKV
    | ReleaseHandover
    | ForgetKVPool
)


# The parts of a sleeping engine that wake separately (vLLM's wake-up tags).
class ControlCall(msgspec.Struct, tag="call", array_like=True):
    """A call on the control socket, answered by a `ControlReply` with the same `call_id`:
    "stats", or one of sleep mode's ("sleep_1", "sleep_2", "wake_up" or
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

    def error(self) -> BaseException:
        """The exception the frontend raises for it (an "internal" one's traceback is
        logged where it is raised)."""
        kinds = {"invalid": ValueError, "os": OSError}
        return kinds.get(self.kind, RuntimeError)(self.message)


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
