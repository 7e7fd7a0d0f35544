"""Prefill/decode disaggregation inside one engine core: what a prefill core hands a decode
core once a request's prompt has run and its first tokens are sampled.

A prefill core runs a handed-over request (`EngineCore.add_request(..., handover=True)`) as
usual until every completion has its first token (or has ended). It then ends the request
there but keeps each live completion's blocks (`HandoverLedger.release` frees them),
and offers a `KVHandover` naming them: every plane under last_exited, only the final one
under shared_decode, whose other planes are gone by then. The blocks hold the prompt, and
the decode inputs of a completion that decoded on while its siblings were still
prefilling. A decode core takes it with `Disaggregation.import_request`: each live completion
enters a slot already decoding, its K/V copied from the prefill core's pool into fresh
blocks before the pass that first reads them (`ModelRunner.import_kv`), and continues as it
would have on the prefill core (sampling noise depends only on the seed and the token's
number, so seeded and greedy outputs equal a colocated run). `HandoverLedger.ended` and
`settle` say when the prefill core's blocks may go.
"""

from __future__ import annotations

import itertools
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from vllm_rlt.config import require
from vllm_rlt.core.kv_cache_manager import KVCacheManager, block_hashes
from vllm_rlt.core.request import Request, RequestStatus
from vllm_rlt.engine.request_group import RequestGroup
from vllm_rlt.sampling_params import SamplingParams
from vllm_rlt.worker.kv_pool import KVBlocks, KVPool, KVSource, PeerKVPool


@dataclass
class HandedCompletion:
    """One completion at the handover: its seed, what it produced so far (its first token,
    with exit depth and logprobs, or more while its siblings were still prefilling) and, if
    it still runs, where the K/V of every position it has computed (the prompt and each
    output but the last) lies in the prefill core's pool; an ended one has its finish
    reason instead."""

    index: int
    seed: int
    output_token_ids: list[int]
    exit_depths: list[int]
    logprobs: list[float]
    ranks: list[int]
    top_logprobs: list[tuple[tuple[int, float], ...]]
    finish_reason: str | None = None
    kv: KVBlocks | None = None

    @property
    def nbytes(self) -> int:
        return 0 if self.kv is None else self.kv.nbytes


@dataclass
class KVHandover:
    """A request whose prompt a prefill core ran, ready to decode elsewhere. The frontend
    has had its first tokens and its prompt logprobs from the prefill core; `pool` is that
    core's KV pool: its own as offered, opened as a peer on the decode core."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    completions: list[HandedCompletion] = field(default_factory=list)
    pool: KVPool | PeerKVPool | None = None

    @property
    def nbytes(self) -> int:
        """K/V bytes moved: one copy of the prompt per live completion."""
        return sum(completion.nbytes for completion in self.completions)


def hand_over(
    group: RequestGroup, lend_kv: Callable[[Request], KVBlocks], pool: KVPool
) -> KVHandover:
    """The handover of `group`, whose completions all have their first tokens or have
    ended: `lend_kv(completion)` keeps a live one's blocks for the decode core. Completions
    of one request reach their first tokens in different passes and decode on meanwhile, so
    the blocks cover every position a completion has computed."""
    completions = [
        HandedCompletion(
            index=index,
            seed=child.seed,
            output_token_ids=list(child.output_token_ids),
            exit_depths=list(child.exit_depths),
            logprobs=list(child.logprobs),
            ranks=list(child.ranks),
            top_logprobs=list(child.top_logprobs),
            finish_reason=group.finish_reasons.get(index),
            kv=None if child.is_finished else lend_kv(child),
        )
        for index, child in enumerate(group.children)
    ]
    params = group.children[0].params
    return KVHandover(group.request_id, group.prompt_token_ids, params, completions, pool)


def continue_completions(group: RequestGroup, handover: KVHandover) -> list[Request]:
    """Give a newly checked `group` the handed-over completions' state; returns the live
    ones, to queue (each brings its K/V for admission). Nothing is queued on an error."""
    require(
        len(handover.completions) == len(group.children),
        f"a handover carries every completion: {len(group.children)}, got "
        f"{len(handover.completions)}",
        "completions",
    )
    live = []
    pairs = zip(group.children, handover.completions, strict=True)
    for index, (child, handed) in enumerate(pairs):
        child.seed = handed.seed
        child.prompt_logprobs = None  # reported by the prefill core
        child.output_token_ids = list(handed.output_token_ids)
        child.exit_depths = list(handed.exit_depths)
        child.logprobs = list(handed.logprobs)
        child.ranks = list(handed.ranks)
        child.top_logprobs = list(handed.top_logprobs)
        if handed.finish_reason is not None:
            child.status = RequestStatus.FINISHED
            child.finish_reason = handed.finish_reason
            group.finish_reasons[index] = handed.finish_reason
            group.finish_sent.add(index)
            continue
        positions = child.prefill_len
        brought = None if handed.kv is None else handed.kv.num_positions
        require(
            bool(child.output_token_ids) and brought == positions and handover.pool is not None,
            f"a live completion brings its first token and the K/V of its {positions} "
            f"computed positions, got {brought}",
            "completions",
        )
        assert handed.kv is not None and handover.pool is not None
        child.kv_import = KVSource(handover.pool, handed.kv)
        child.first_token_time = time.monotonic()
        live.append(child)
    group.sent = [len(child.output_token_ids) for child in group.children]
    group.prompt_logprobs_sent = True
    return live


PROMPTS_HASHED = 256  # prompts whose block hashes a decode core keeps between pieces


class HandoverLedger:
    """One core's handovers in progress: on a prefill core the blocks it lent to decode
    cores, by request; on a decode core the imports whose source a copy may still read."""

    def __init__(self, kv: KVCacheManager, pool: KVPool, position_bytes: int) -> None:
        self.kv = kv
        self.pool = pool
        self.position_bytes = position_bytes  # K/V bytes of one position, every plane
        # request id -> per handover of that id (oldest first: an id may come back once
        # its request has ended), the tables it lent
        self.lent: dict[str, deque[list[tuple[str, int]]]] = {}
        # request id -> its imports in the order they came (an id may come back before an
        # aborted import of it is reported): the live completions each queued, or None
        # for one refused before anything was queued
        self.importing: dict[str, deque[list[Request] | None]] = {}
        self.prefetching: deque[Prefetching] = deque()  # decode side, in stream order
        # decode side: request id -> (prompt tokens, their block hashes) of its blocks
        # moved so far, so that the next piece hashes only its own blocks
        self._hashed: OrderedDict[str, tuple[list[int], list[bytes]]] = OrderedDict()
        self._keys = itertools.count()

    def hand_over(self, group: RequestGroup) -> KVHandover:
        """The handover of `group` (see `hand_over`), its live completions' blocks kept
        past their end here until `release`."""
        keys: list[tuple[str, int]] = []

        def lend(child: Request) -> KVBlocks:
            key = ("lent", next(self._keys))
            self.kv.lend(child.request_id, key)
            keys.append(key)
            positions = child.prefill_len
            blocks = self.kv.block_table(key)[: self.kv.blocks_for(positions)]
            return KVBlocks(list(blocks), positions, positions * self.position_bytes)

        try:
            handover = hand_over(group, lend, self.pool)
        except Exception:
            for key in keys:
                self.kv.free(key)
            raise
        self.lent.setdefault(group.request_id, deque()).append(keys)
        return handover

    def lend_prefix(self, request_id: str, owner: str, first: int, count: int) -> list[int]:
        """Keep blocks [first, first + count) of `owner`'s table (a completion of
        `request_id` still prefilling) for a decode core's prefetch, until `release`: a
        lend like a handover's, released in the order lent."""
        key = ("lent", next(self._keys))
        blocks = self.kv.share(owner, key, first, count)
        self.lent.setdefault(request_id, deque()).append([key])
        return blocks

    def release(self, request_id: str) -> bool:
        """Free what the oldest handover of `request_id` lent (the decode core has its
        copy, or never will); False if nothing was lent."""
        handovers = self.lent.get(request_id)
        if not handovers:
            return False
        for key in handovers.popleft():
            self.kv.free(key)
        if not handovers:
            del self.lent[request_id]
        return True

    def add_prefetch(
        self, request_id: str, done: Any, source: Any, end: int, lent: bool = True
    ) -> None:
        entry = Prefetching(next(self._keys), request_id, done, source, end, lent)
        self.prefetching.append(entry)

    def prompt_hashes(
        self, request_id: str, salt: bytes, tokens: list[int], block_size: int, keep: bool = True
    ) -> list[bytes]:
        """Block hashes of `tokens`, the first blocks of a prompt whose blocks arrive in
        pieces: those of an earlier piece of the same prompt (its tokens checked) are kept
        for the last PROMPTS_HASHED requests, not computed again (`keep` False: the last
        piece, its request's import)."""
        kept = self._hashed.pop(request_id, None)
        known = kept[1] if kept is not None and tokens[: len(kept[0])] == kept[0] else []
        hashes = block_hashes(salt, tokens, block_size, known)
        if keep:
            self._hashed[request_id] = (tokens, hashes)
            while len(self._hashed) > PROMPTS_HASHED:
                self._hashed.popitem(last=False)
        return hashes

    def prefetched_up_to(self, request_id: str) -> int:
        """The end of the prompt blocks of `request_id` whose copy is still under way."""
        ends = [entry.end for entry in self.prefetching if entry.request_id == request_id]
        return max(ends, default=0)

    def add_import(self, request_id: str, live: list[Request] | None) -> None:
        """An import queued with its `live` completions, or refused (None)."""
        self.importing.setdefault(request_id, deque()).append(live)

    def ended(self) -> tuple[list[tuple[int, bool]], list[str]]:
        """What has ended as this rank sees it, changing nothing the ranks share: the
        prefetches whose copy is done (serial, whether it worked) and the imports whose
        source nobody here reads any more (the oldest of each id: each live completion's
        copy is done, or it ended before its admission; also one refused at once)."""
        prefetches = [
            (entry.serial, not getattr(entry.done, "failed", False))
            for entry in self.prefetching
            if _event_done(entry.done)
        ]
        imports = [
            request_id
            for request_id, queued in self.importing.items()
            if queued[0] is None or all(_source_unread(child) for child in queued[0])
        ]
        return prefetches, imports

    def settle(
        self, prefetches: list[tuple[int, bool]], imports: list[str]
    ) -> tuple[list[str], list[str]]:
        """Act on what every rank saw end (`ended`): connector reads enter the prefix cache
        where they worked on every rank (else their blocks are only freed); prefetches are
        reported in stream order (a request id each, up to the first still running), and
        an import after every prefetch of its request (the prefill core frees the oldest of
        its lends first), each once. Returns (prefetched, copied)."""
        agreed = dict(prefetches)
        for entry in self.prefetching:
            if entry.serial in agreed and hasattr(entry.done, "finish"):
                entry.done.finish(agreed[entry.serial])
        prefetched = []
        while self.prefetching and self.prefetching[0].serial in agreed:
            entry = self.prefetching.popleft()
            if entry.lent:
                prefetched.append(entry.request_id)
        waiting = {entry.request_id for entry in self.prefetching}
        copied = []
        for request_id in imports:
            queued = self.importing.get(request_id)
            if request_id in waiting or not queued:
                continue
            queued.popleft()
            if not queued:
                del self.importing[request_id]
            copied.append(request_id)
        return prefetched, copied


@dataclass
class Prefetching:
    """A decode core's copy of prompt blocks lent early, or read ahead of an import
    (engine/disagg/prefetch.py): `done` is None (done at once), a CUDA event, or a connector's
    reads (`query` polls them, `finish` caches their blocks); `source`, the pool it reads,
    stays open until then. Its blocks end at table index `end`; a `lent` one is reported
    (the prefill core then frees that lend)."""

    serial: int
    request_id: str
    done: Any
    source: Any
    end: int
    lent: bool = True


def _event_done(event: Any) -> bool:
    return event is None or event.query()


def _source_unread(child: Request) -> bool:
    if child.kv_copy is not None:
        if not child.kv_copy.query():
            return False
        child.kv_copy = None
    return child.kv_import is None or child.is_finished
