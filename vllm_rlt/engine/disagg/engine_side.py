"""Prefill/decode disaggregation as a part of one engine core (`EngineCore.disagg`, built
only for `--disaggregate`): what a prefill core offers and lends (engine/disagg/handover.py,
prefetch.py), a decode core's imports and early copies, and the transport's ends on every
tensor-parallel rank (engine/disagg/links.py). The engine core calls its hooks around each
step; the calls that change the engine are mirrored to the other ranks as "disagg.NAME"
(parallel/tensor_parallel.py), and outcomes one rank alone cannot know (a pool opened, a
copy done) are agreed among ranks first, so their engines stay equal."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any, Protocol

from vllm_rlt.config import require
from vllm_rlt.core.contract import NewSlot
from vllm_rlt.core.kv_cache_manager import KVCacheManager
from vllm_rlt.core.request import Request
from vllm_rlt.core.scheduler import Scheduler
from vllm_rlt.engine.core_outputs import RequestDelta
from vllm_rlt.engine.disagg.connector import PoolHandle
from vllm_rlt.engine.disagg.handover import HandoverLedger, KVHandover, continue_completions
from vllm_rlt.engine.disagg.links import KVLinks
from vllm_rlt.engine.disagg.prefetch import (
    PromptBlocks,
    PromptPrefetcher,
    early_reads_landed,
    prefetch_into,
)
from vllm_rlt.engine.request_group import RequestGroup, RequestGroups
from vllm_rlt.parallel.tensor_parallel import mirror_part, mirrored
from vllm_rlt.sampling_params import SamplingParams
from vllm_rlt.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


class EngineParts(Protocol):
    """What disaggregation uses of its engine core (engine/engine_core.py)."""

    model: Any
    scheduler: Scheduler
    runner: ModelRunner
    kv: KVCacheManager
    groups: RequestGroups
    mirror: Callable[[str, tuple, dict], None] | None

    def new_group(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> RequestGroup: ...


class Disaggregation:
    """One engine core's handovers: offered and lent on a prefill core, imported and copied
    on a decode core (a core may be both)."""

    def __init__(self, engine: EngineParts) -> None:
        self.engine = engine
        self.scheduler, self.runner, self.kv = engine.scheduler, engine.runner, engine.kv
        runner = engine.runner
        self.ledger = HandoverLedger(self.kv, runner.kv_pool, runner.kv_position_bytes)
        group = engine.model.tensor_parallel
        self.links = KVLinks(lambda: runner.kv_pool, 0 if group is None else group.rank)
        self.prefetcher = PromptPrefetcher(engine.scheduler, self.ledger)
        self.handovers: list[KVHandover] = []  # prefill side: offered, not yet taken
        self.prefetches: list[PromptBlocks] = []  # prefill side: lent early, not yet sent
        self.settled: dict[str, int] | None = None  # read before this step's schedule

    @property
    def mirror(self) -> Callable[[str, tuple, dict], None] | None:
        return mirror_part(self.engine.mirror, "disagg")

    # ----------------------------------------------------------------- engine hooks
    def watch(self, group: RequestGroup) -> None:
        """A new request to hand over once its completions have their first tokens."""
        group.handover = True
        self.prefetcher.watch(group)

    def before_schedule(self) -> None:
        """Note the prompt blocks finished so far, before this step schedules its pass
        (engine/disagg/prefetch.py)."""
        self.settled = self.prefetcher.settled() if self.prefetcher.watched else None

    @property
    def in_transit(self) -> bool:
        """Blocks lent to decode cores, or early reads an import waits for: an empty pass
        may just wait for them."""
        return bool(self.ledger.lent or self.ledger.prefetching)

    def after_admit(
        self, new_slots: tuple[NewSlot, ...], failed: list[tuple[NewSlot, BaseException]]
    ) -> list[tuple[NewSlot, BaseException]]:
        """The admissions that failed (`failed`, the runner's), with the imports whose copy
        failed on another tensor-parallel rank; the other imports' whole prompt blocks
        enter the prefix cache, and their source may go once the copies queued here are
        done."""
        imports = [new for new in new_slots if new.imported_kv is not None]
        if not imports:
            return failed
        here = {new.slot for new, _ in failed}
        elsewhere = set().union(*map(set, self._gathered(sorted(here)))) - here
        failed = failed + [
            (new, RuntimeError("the K/V copy failed on another tensor-parallel rank"))
            for new in new_slots
            if new.slot in elsewhere
        ]
        done = self.runner.copies_done()
        failed_slots = {new.slot for new, _ in failed}
        for new in imports:
            request = self.scheduler.running[new.slot]
            request.kv_copy = done
            if new.slot not in failed_slots:
                self.scheduler.known.register_imported(request)
        return failed

    def after_step(self, progressed: list[RequestGroup]) -> list[RequestDelta]:
        """Hand over the groups ready to go (the deltas of those whose handover failed),
        then lend the prompt blocks finished since the last step."""
        groups, failures = self.engine.groups, []
        for group in progressed:
            if group.handover and group.ready_to_hand_over:  # an ended group is never ready
                try:
                    self._hand_over(group)
                except Exception as error:  # noqa: BLE001 - fails this request only
                    failures.append(groups.delta(groups.fail(group.children[0], error)))
        if self.settled is not None:
            planned = self.prefetcher.plan(self.settled)
            if self.links.rank == 0:
                self.prefetches += planned
        return failures

    def require_idle(self, hook: str, field: str) -> None:
        ledger = self.ledger
        require(
            not (ledger.lent or ledger.importing or ledger.prefetching),
            f"{hook} needs an idle engine: K/V handed to or from another engine is in transit",
            field,
        )

    def wait_ms(self, busy: bool, held_back: bool) -> int | None:
        """How long the core process may wait for commands: with work, only while held
        back (1 ms while early reads run, else 10 ms for lent blocks); idle, 1 ms while
        copies run (None: until a command comes)."""
        prefetching = bool(self.ledger.prefetching)
        if busy:
            return (1 if prefetching else 10) if held_back else 0
        return 1 if self.ledger.importing or prefetching else None

    def sleep_refusal(self) -> str | None:
        """Why this core must not sleep (None: it may): its pool is read by decode cores,
        or registered with a connector at its present address."""
        if self.links.shared is not None:
            return "sleep is not available once decode cores read this core's KV pool"
        if self.links.opened.holds_local_pool:
            return "sleep is not available once a connector has registered this core's KV pool"
        return None

    def close(self) -> None:
        self.links.close()

    # ----------------------------------------------------------------- decode side
    @mirrored
    def import_request(self, handover: KVHandover) -> None:
        """Continue a request a prefill core ran (engine/disagg/handover.py): every live
        completion decodes from its first token with its K/V written at admission; the
        first tokens and prompt logprobs are not reported again. Checked like a new
        request; any error leaves the engine untouched. Its pool is one at hand, or a
        handle per tensor-parallel rank (engine/disagg/links.py)."""
        request_id = str(handover.request_id)
        try:
            handover = dataclasses.replace(handover, pool=self._source(handover.pool))
            group = self.engine.new_group(request_id, handover.prompt_token_ids, handover.params)
            live = continue_completions(group, handover)
        except Exception:
            self.ledger.add_import(request_id, None)
            raise
        self._read_ahead(handover, live)
        if self.kv.enable_caching:  # the hashes of its pieces moved early serve admission
            salt, size = self.scheduler.cache_salt, self.kv.block_size
            prompt = handover.prompt_token_ids
            hashes = self.ledger.prompt_hashes(request_id, salt, prompt, size, keep=False)
            for child in live:
                child.block_hashes = hashes
        landed = early_reads_landed(self.ledger.prefetching, request_id)
        if landed is not None:
            for child in live:
                child.kv_import = dataclasses.replace(child.kv_import, landed=landed)
        self.engine.groups.queue(group, live)
        self.ledger.add_import(request_id, live)

    @mirrored
    def prefetch_kv(self, blocks: PromptBlocks, source: object) -> None:
        """Copy prompt blocks a prefill core lent early from its pool `source` (as for
        `import_request`) into this core's prefix cache (engine/disagg/prefetch.py);
        `collect_transfers` says when that copy is done. A copy that cannot be made is
        skipped: the import copies them."""
        try:
            source = self._source(source)
            done = prefetch_into(self.scheduler, self.runner, self.ledger, source, blocks)
        except Exception:  # noqa: BLE001 - the import then copies these blocks itself
            logger.warning("prefetch of %s skipped", blocks.request_id, exc_info=True)
            done = None
        self.ledger.add_prefetch(blocks.request_id, done, source, blocks.end)

    def _read_ahead(self, handover: KVHandover, live: list[Request]) -> None:
        """An import read outside this core's stream (not `in_stream`): read its whole
        prompt blocks that no prefetch covers now, like blocks lent early, so that the read
        that pauses this core's passes at admission shrinks to what follows them."""
        first = self.ledger.prefetched_up_to(handover.request_id)
        whole = len(handover.prompt_token_ids) // self.kv.block_size
        if not live or whole <= first or handover.pool.in_stream:
            return
        kv = next(c.kv for c in handover.completions if c.kv is not None)
        prompt = handover.prompt_token_ids[: whole * self.kv.block_size]
        blocks = PromptBlocks(handover.request_id, prompt, first, kv.blocks[first:whole])
        try:
            done = prefetch_into(self.scheduler, self.runner, self.ledger, handover.pool, blocks)
        except Exception:  # noqa: BLE001 - the admission reads them itself
            logger.warning("read-ahead of %s skipped", blocks.request_id, exc_info=True)
            return
        if done is not None:
            self.ledger.add_prefetch(blocks.request_id, done, handover.pool, whole, lent=False)

    @mirrored
    def refuse_import(self, request_id: str) -> None:
        """An import refused before it reached `import_request`: reported as copied."""
        self.ledger.add_import(request_id, None)

    @mirrored
    def collect_transfers(self) -> tuple[list[str], list[str]]:
        """The prefetches and imports whose source blocks the prefill core may free now, as
        every tensor-parallel rank sees them (`HandoverLedger.settle`)."""
        prefetches, imports = self.ledger.ended()
        views = self._gathered((prefetches, imports))
        if len(views) > 1:  # ended on every rank; worked if it worked on every rank
            seen = [dict(ended) for ended, _ in views]
            prefetches = [
                (serial, all(view[serial] for view in seen))
                for serial, _ in prefetches
                if all(serial in view for view in seen)
            ]
            imports = [i for i in imports if all(i in view for _, view in views)]
        return self.ledger.settle(prefetches, imports)

    # ----------------------------------------------------------------- prefill side
    @mirrored
    def release_handover(self, request_id: str) -> bool:
        """Free what the oldest handover of `request_id` lent (`HandoverLedger.release`)."""
        return self.ledger.release(request_id)

    def take_handovers(self) -> list[KVHandover]:
        """The requests this core handed over since the last call."""
        taken, self.handovers = self.handovers, []
        return taken

    def take_prefetches(self) -> list[PromptBlocks]:
        """Prompt blocks of handed-over requests lent since the last call, before their
        handover (engine/disagg/prefetch.py)."""
        taken, self.prefetches = self.prefetches, []
        return taken

    def _hand_over(self, group: RequestGroup) -> None:
        """Offer the request and end it here without a word to the frontend: it goes on
        elsewhere."""
        handover = self.ledger.hand_over(group)
        self.prefetcher.forget(group.request_id)
        group.end(self.scheduler, "handover")
        self.engine.groups.remove(group)
        if self.links.rank == 0:  # the others lend alike; rank 0 offers for all
            self.handovers.append(handover)

    # ------------------------------------------------- the transport, on every rank
    @mirrored
    def share_kv(self, connector: str) -> list[PoolHandle]:
        """This core's pool as decode cores read it through `connector`: a handle per
        tensor-parallel rank (any rank's failure raised on all)."""
        try:
            handle, error = self.links.share(connector), None
        except Exception as exc:  # noqa: BLE001 - raised below, on every rank
            handle, error = None, f"{type(exc).__name__}: {exc}"
        views = self._gathered((handle, error))
        errors = [error for _, error in views if error is not None]
        if errors:
            raise RuntimeError(errors[0])
        return [handle for handle, _ in views]

    @mirrored
    def open_kv(self, pools: list[PoolHandle]) -> str | None:
        """Open a prefill core's pool (a handle per rank) and read from it: the first
        rank's error, or None."""
        try:
            self.links.probe(pools, self.engine.model.device)
            error = None
        except Exception as exc:  # noqa: BLE001 - answered: the start-up stops
            error = f"{type(exc).__name__}: {exc}"
        return next((e for e in self._gathered(error) if e is not None), None)

    @mirrored
    def forget_kv(self, pool_id: str) -> None:
        """A prefill core is gone: let go of its pool (engine/disagg/links.py)."""
        self.links.opened.forget(pool_id)

    def _source(self, pools: Any) -> Any:
        """The pool `pools` names (`KVLinks.source`), opened on every tensor-parallel rank
        or on none: one rank's failure fails the call on all, so their engines stay equal."""
        try:
            source, error = self.links.source(pools), None
        except Exception as exc:  # noqa: BLE001 - raised below, on every rank
            source, error = None, exc
        failures = self._gathered(None if error is None else f"{type(error).__name__}: {error}")
        if error is not None:
            raise error
        failure = next((failure for failure in failures if failure is not None), None)
        if failure is not None:
            raise RuntimeError(f"another tensor-parallel rank cannot open the pool: {failure}")
        return source

    def _gathered(self, value):
        """Every tensor-parallel rank's `value` (this one's alone without them)."""
        group = self.engine.model.tensor_parallel
        return [value] if group is None else group.gather(value)
