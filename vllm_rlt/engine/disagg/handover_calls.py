"""The engine core's calls of prefill/decode disaggregation (engine/disagg/handover.py): a
decode core's imports and early copies, the transport's ends on every tensor-parallel
rank (engine/disagg/links.py), and what a prefill core offers. `EngineCore` inherits them;
those that change the engine are mirrored to the other ranks like its own calls, and
outcomes one rank alone cannot know (a pool opened, a copy done) are agreed among ranks
first, so their engines stay equal."""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING, Any

from vllm_rlt.core.request import Request
from vllm_rlt.engine.disagg.handover import KVHandover, continue_completions
from vllm_rlt.engine.disagg.prefetch import PromptBlocks, early_reads_landed, prefetch_into
from vllm_rlt.engine.disagg.torch_connector import KVPoolHandle
from vllm_rlt.engine.request_group import RequestGroup
from vllm_rlt.parallel.tensor_parallel import mirrored
from vllm_rlt.worker.kv_pool import KVPool

if TYPE_CHECKING:
    from vllm_rlt.core.kv_cache_manager import KVCacheManager
    from vllm_rlt.core.scheduler import Scheduler
    from vllm_rlt.engine.disagg.handover import HandoverLedger
    from vllm_rlt.engine.disagg.links import KVLinks
    from vllm_rlt.engine.disagg.prefetch import PromptPrefetcher
    from vllm_rlt.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


class HandoverCalls:
    """Mixed into `EngineCore`, whose state they use."""

    ledger: HandoverLedger
    links: KVLinks
    scheduler: Scheduler
    runner: ModelRunner
    kv: KVCacheManager
    prefetcher: PromptPrefetcher
    handovers: list[KVHandover]  # prefill side: offered, not yet taken
    prefetches: list[PromptBlocks]  # prefill side: lent early, not yet sent

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
            group = self._new_group(request_id, handover.prompt_token_ids, handover.params)
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
        self._queue(group, live)
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
        """An import read through a connector (outside this core's stream): read its whole
        prompt blocks that no prefetch covers now, like blocks lent early, so that the read
        that pauses this core's passes at admission shrinks to what follows them."""
        first = self.ledger.prefetched_up_to(handover.request_id)
        whole = len(handover.prompt_token_ids) // self.kv.block_size
        if isinstance(handover.pool, KVPool) or not live or whole <= first:
            return
        kv = live[0].kv_import.blocks
        prompt = handover.prompt_token_ids[: whole * self.kv.block_size]
        blocks = PromptBlocks(handover.request_id, prompt, first, kv.blocks[first:whole])
        try:
            done = prefetch_into(self.scheduler, self.runner, self.ledger, handover.pool, blocks)
        except Exception:  # noqa: BLE001 - the admission reads them itself
            logger.warning("read-ahead of %s skipped", blocks.request_id, exc_info=True)
            return
        if done is not None:
            self.ledger.add_prefetch(blocks.request_id, done, handover.pool, whole, lent=False)

    # ------------------------------------------------- the transport, on every rank
    @mirrored
    def share_kv(self, connector: str) -> list[KVPoolHandle]:
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

    @mirrored
    def open_kv(self, pools: list[KVPoolHandle]) -> str | None:
        """Open a prefill core's pool (a handle per rank) and read from it: the first
        rank's error, or None."""
        try:
            source = self.links.source(pools)
            self.links.opened.probe(source, self.model.device)
            error = None
        except Exception as exc:  # noqa: BLE001 - answered: the start-up stops
            error = f"{type(exc).__name__}: {exc}"
        return next((e for e in self._gathered(error) if e is not None), None)

    @mirrored
    def forget_kv(self, pool_id: str) -> None:
        """A prefill core is gone: let go of its pool (engine/disagg/torch_connector.py)."""
        self.links.opened.forget(pool_id)

    @mirrored
    def release_handover(self, request_id: str) -> bool:
        """Free what the oldest handover of `request_id` lent (`HandoverLedger.release`)."""
        return self.ledger.release(request_id)

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

    def _gathered(self, value):
        """Every tensor-parallel rank's `value` (this one's alone without them)."""
        group = getattr(self.model, "tensor_parallel", None)
        return [value] if group is None else group.gather(value)

    def take_handovers(self) -> list[KVHandover]:
        """The requests this core handed over since the last call (see `add_request`)."""
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
        self.groups.remove(group)
        if self.links.rank == 0:  # the others lend alike; rank 0 offers for all
            self.handovers.append(handover)
