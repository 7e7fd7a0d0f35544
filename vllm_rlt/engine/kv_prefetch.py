"""Moving a long prompt's K/V while its later chunks still run (prefill/decode
disaggregation, engine/kv_handover.py).

A prefill core that runs a prompt in several chunks lends each whole block a finished
chunk completed (`PromptPrefetcher.plan`), and the frontend passes it to the decode core
chosen for the request, which copies it into its prefix cache at once (`prefetch_into`). At
the handover that core finds those blocks cached and copies only the rest, so the copy
that delays the request's next token shrinks to the last chunk's blocks.

Only layouts with one block table per request (last_exited, shared) take part: the decode
core's prefix cache serves an import there (shared_decode keeps per-loop tables and no
prefix cache). A block is lent once its writes are done: its chunk's pass has been
collected, which is why `settled` is read before each step schedules its pass.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm_rlt.core.kv_cache_manager import KVCacheManager, block_hashes
from vllm_rlt.core.scheduler import Scheduler
from vllm_rlt.engine.kv_handover import HandoverLedger
from vllm_rlt.engine.request_group import RequestGroup
from vllm_rlt.worker.kv_pool import KVPool, copy_kv
from vllm_rlt.worker.model_runner import ModelRunner


@dataclass
class PromptBlocks:
    """Whole prompt blocks of one request a prefill core has lent early: table indices
    [first, first + len(blocks)), holding the positions of `prompt_token_ids` (the prompt
    up to the last of them)."""

    request_id: str
    prompt_token_ids: list[int]
    first: int
    blocks: list[int]


class PromptPrefetcher:
    """Prefill side: the handed-over requests still prefilling, and how many of their
    prompt blocks were lent so far."""

    def __init__(self, scheduler: Scheduler, ledger: HandoverLedger) -> None:
        self.scheduler = scheduler
        self.ledger = ledger
        self.enabled = scheduler.table_planes == 1
        self.watched: dict[str, tuple[RequestGroup, int]] = {}  # id -> (group, blocks lent)

    def watch(self, group: RequestGroup) -> None:
        if self.enabled:
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
    scheduler: Scheduler, runner: ModelRunner, source: Any, blocks: PromptBlocks
) -> Any:
    """Decode side: copy the prompt blocks of `blocks` this core's prefix cache lacks from
    `source` (a prefill core's pool mapped here) into fresh blocks, registered in the cache
    and released at once (cached, evictable: an import that finds them skips their copy).
    Returns what says the copy is done (None: done, or nothing was copied: a layout or pool
    that cannot take it, or too few free blocks)."""
    kv: KVCacheManager = scheduler.kv
    ours = runner.kv_pool
    usable = (
        kv.enable_caching
        and scheduler.table_planes == 1
        and isinstance(source, KVPool)
        and source.geometry == ours.geometry
        and source.block_size == kv.block_size
    )
    if not usable:
        return None
    size, first = kv.block_size, blocks.first
    hashes = block_hashes(scheduler.cache_salt, blocks.prompt_token_ids, size)
    lent = range(first, first + len(blocks.blocks))
    missing = [index for index in lent if not kv.count_hits([hashes[index]])]
    if not missing or len(missing) > kv.num_free_blocks // 2:  # leave room for passes
        return None
    owner = ("prefetch", blocks.request_id, first)
    taken = [block for _, block in kv.grow(owner, len(missing) * size)]
    try:
        for run in _consecutive(missing):
            sources = [blocks.blocks[i - first] for i in run]
            targets = taken[: len(run)]
            taken_before = [0] * run[0]  # indices below the run are not read
            copy_kv(
                source,
                taken_before + sources,
                ours,
                taken_before + targets,
                run[0] * size,
                (run[-1] + 1) * size,
            )
            taken = taken[len(run) :]
        for index, block_index in enumerate(missing):
            kv.register(owner, index, hashes[block_index])
    finally:
        kv.free(owner)
    return runner.copies_done()


def _consecutive(indices: list[int]) -> list[list[int]]:
    """`indices` (ascending) cut into runs of consecutive ones."""
    runs: list[list[int]] = []
    for index in indices:
        if runs and runs[-1][-1] + 1 == index:
            runs[-1].append(index)
        else:
            runs.append([index])
    return runs
