"""Moving a long prompt's K/V while its later chunks still run (prefill/decode
disaggregation, engine/disagg/handover.py).

A prefill core that runs a prompt in several chunks lends each whole block a finished
chunk completed (`PromptPrefetcher.plan`), and the frontend passes it to the decode core
chosen for the request, which copies it into its prefix cache at once (`prefetch_into`). At
the handover that core finds those blocks cached and copies only the rest, so the copy
that delays the request's next token shrinks to the last chunk's blocks.

Every layout takes part: a block holds every plane an import brings (all of them under
last_exited, the final one under shared_decode, whose prefix cache holds only such
blocks). A block is lent once its writes are done: its chunk's pass has been collected,
which is why `settled` is read before each step schedules its pass.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from vllm_rlt.core.kv_cache_manager import KVCacheManager
from vllm_rlt.core.scheduler import Scheduler
from vllm_rlt.engine.disagg.handover import HandoverLedger, Prefetching
from vllm_rlt.engine.request_group import RequestGroup
from vllm_rlt.worker.kv_pool import KVBlocks, PeerKVPool
from vllm_rlt.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)
_OWNER_KEYS = itertools.count()  # a request id may come back while its old reads run


@dataclass
class PromptBlocks:
    """Whole prompt blocks of one request a prefill core has lent early: table indices
    [first, first + len(blocks)), holding the positions of `prompt_token_ids` (the prompt
    up to the last of them)."""

    request_id: str
    prompt_token_ids: list[int]
    first: int
    blocks: list[int]

    @property
    def end(self) -> int:
        return self.first + len(self.blocks)


class PromptPrefetcher:
    """Prefill side: the handed-over requests still prefilling, and how many of their
    prompt blocks were lent so far."""

    def __init__(self, scheduler: Scheduler, ledger: HandoverLedger) -> None:
        self.scheduler = scheduler
        self.ledger = ledger
        self.watched: dict[str, tuple[RequestGroup, int]] = {}  # id -> (group, blocks lent)

    def watch(self, group: RequestGroup) -> None:
        self.watched[group.request_id] = (group, 0)

    def forget(self, request_id: str) -> None:
        self.watched.pop(request_id, None)

    def settled(self) -> dict[str, int]:
        """Whole prompt blocks each watched request has finished in the passes scheduled so
        far: read before a step schedules its pass, they are written once that step has
        collected the pass before it (at most one pass is in flight)."""
        size = self.scheduler.kv.block_size
        return {
            request_id: min(group.children[0].num_prefilled, len(group.prompt_token_ids)) // size
            for request_id, (group, _) in self.watched.items()
        }

    def plan(self, settled: dict[str, int]) -> list[PromptBlocks]:
        """Lend the blocks finished since the last plan (`settled`, capped by what each
        request still holds: a preempted one starts again); stop watching ended requests."""
        kv, size, planned = self.scheduler.kv, self.scheduler.kv.block_size, []
        for request_id, (group, lent) in list(self.watched.items()):
            child = group.children[0]
            if child.is_finished:
                del self.watched[request_id]
                continue
            now = min(child.num_prefilled, len(group.prompt_token_ids)) // size
            done = min(settled.get(request_id, 0), now, len(kv.block_table(child.request_id)))
            if done <= lent:
                continue
            blocks = self.ledger.lend_prefix(request_id, child.request_id, lent, done - lent)
            tokens = group.prompt_token_ids[: done * size]
            planned.append(PromptBlocks(request_id, tokens, lent, blocks))
            self.watched[request_id] = (group, done)
        return planned


def prefetch_into(
    scheduler: Scheduler,
    runner: ModelRunner,
    ledger: HandoverLedger,
    source: PeerKVPool | None,
    blocks: PromptBlocks,
) -> Any:
    """Decode side: copy the prompt blocks of `blocks` this core's prefix cache lacks from
    `source` (a prefill core's pool as opened here) into fresh blocks, registered in the
    cache (at once for a read `in_stream`, once read for another) and released (cached,
    evictable: an import that finds them skips their copy). Returns what says the copy is
    done, with a `query` method
    (None: done, or nothing was copied: a pool that cannot take it, or too few free
    blocks). `ledger` keeps the block hashes of a prompt arriving in pieces."""
    kv: KVCacheManager = scheduler.kv
    ours = runner.kv_pool
    usable = (
        kv.enable_caching
        and source is not None
        and source.geometry == ours.geometry
        and source.block_size == kv.block_size
    )
    if not usable:
        return None
    size, first = kv.block_size, blocks.first
    salt, tokens = scheduler.cache_salt, blocks.prompt_token_ids
    hashes = ledger.prompt_hashes(blocks.request_id, salt, tokens, size)
    lent = range(first, first + len(blocks.blocks))
    missing = [index for index in lent if not kv.count_hits([hashes[index]])]
    if not missing or len(missing) > kv.num_free_blocks // 2:  # leave room for passes
        return None
    # A read out of stream starts behind the pass in flight (taken before any block is).
    after = None if source.in_stream else runner.copies_done()
    owner = ("prefetch", blocks.request_id, next(_OWNER_KEYS))
    taken = [block for _, block in kv.grow(owner, len(missing) * size)]
    sources = [0] * first + blocks.blocks  # tables from position 0; below `first` unread
    targets = [0] * (first + len(blocks.blocks))
    for index, block in zip(missing, taken, strict=True):
        targets[index] = block
    cached = [hashes[index] for index in missing]
    runs = [(run[0] * size, (run[-1] + 1) * size) for run in _consecutive(missing)]
    if source.in_stream:  # ordered before every later pass: cached at once
        try:
            for start, end in runs:
                source.read_into(KVBlocks(sources, end, 0), targets, start)
            for index, block_hash in enumerate(cached):
                kv.register(owner, index, block_hash)
        finally:
            kv.free(owner)
        return runner.copies_done()
    prefetch = ConnectorPrefetch(kv, owner, cached)
    for start, end in runs:
        try:
            read = source.start_read(KVBlocks(sources, end, 0), targets, start, after)
        except Exception:  # noqa: BLE001 - the import copies these blocks itself
            logger.warning("early K/V read of %s failed", blocks.request_id, exc_info=True)
            prefetch.failed = True
            break
        if read is not None:
            prefetch.reads.append(read)
    return prefetch


def early_reads_landed(prefetching: Iterable[Prefetching], request_id: str) -> Any:
    """What says whether the connector reads of `request_id`'s early-lent blocks among
    `prefetching` have been settled (`HandoverLedger.settle`: on every tensor-parallel rank
    alike), or None if none is outstanding."""
    reads = [
        entry.done
        for entry in prefetching
        if entry.request_id == request_id
        and isinstance(entry.done, ConnectorPrefetch)
        and not entry.done.finished
    ]
    if not reads:
        return None
    return lambda: all(read.finished for read in reads)


class ConnectorPrefetch:
    """Blocks a peer reads into outside this core's stream (not `in_stream`, as
    engine/disagg/nixl_connector.py's): held
    until every read has ended (`query` polls), then registered in the prefix cache (not
    before: an import that found them would read them before the bytes are there) and
    released (`finish`). A failed read leaves the blocks out of the cache (the import
    copies them)."""

    def __init__(self, kv: KVCacheManager, owner: tuple, cached: list[bytes]) -> None:
        self.kv, self.owner, self.cached = kv, owner, cached
        self.reads: list[Any] = []
        self.failed = self.finished = False

    def query(self) -> bool:
        pending = []
        for read in self.reads:
            try:
                if not read.done():
                    pending.append(read)
            except Exception:  # noqa: BLE001 - the import copies these blocks itself
                logger.warning("early K/V read of %s failed", self.owner[1], exc_info=True)
                self.failed = True
        self.reads = pending
        return not pending

    def finish(self, cache: bool = True) -> None:
        """Release the blocks, cached if `cache` (every rank's reads worked)."""
        if self.finished:
            return
        if cache and not self.failed:
            for index, block_hash in enumerate(self.cached):
                self.kv.register(self.owner, index, block_hash)
        self.kv.free(self.owner)
        self.finished = True


def _consecutive(indices: list[int]) -> list[list[int]]:
    """`indices` (ascending) cut into runs of consecutive ones."""
    runs: list[list[int]] = []
    for index in indices:
        if runs and runs[-1][-1] + 1 == index:
            runs[-1].append(index)
        else:
            runs.append([index])
    return runs
