"""Loop-level continuous batching: admission, the rows of each pass, blocks taken as
positions are about to be written, and exact preemption when they run out."""

from __future__ import annotations

from collections import deque
from operator import attrgetter

from vllm_rlt.config import SchedulerConfig, SpeculativeConfig
from vllm_rlt.core.contract import (
    ModelRunnerOutput,
    NewSlot,
    SchedulerOutput,
)
from vllm_rlt.core.known_blocks import KnownBlocks
from vllm_rlt.core.kv_cache_manager import KVCacheManager
from vllm_rlt.core.request import Request, RequestStatus
from vllm_rlt.core.stopping import token_stop


class Scheduler:
    """Decides each pass's rows; never touches a device.

    Every pass carries, in order: one decode row per running request whose token may run
    (all of them in refill mode; in no_refill mode only unfinished tokens until the whole
    cohort has exited), the next loop of every prefill chunk in flight, then new prefill
    chunks while the row budget allows. A started token or chunk runs every pass until done.
    """

    def __init__(
        self,
        config: SchedulerConfig,
        kv: KVCacheManager,
        num_loops: int,
        one_position_prefill: bool,
        cache_salt: bytes = b"",
        table_planes: int = 1,
        speculation: SpeculativeConfig | None = None,
        lanes_per_request: int = 1,
        seeded_prefixes: bool = False,
    ) -> None:
        """`seeded_prefixes`: a prompt's K/V depends on its request's seed too (the model
        draws its initial state from it), so only requests of one seed share cached blocks."""
        if not config.is_sized:
            raise ValueError("the scheduler needs a sized config (engine/device_defaults.py)")
        self.config = config
        self.kv = kv
        self.num_loops = num_loops
        # SHARED layout: a position must finish every loop before the next one starts.
        self.chunk_limit = 1 if one_position_prefill else config.prefill_chunk_size
        # Block-table rows per slot (see KVGeometry). Above one (SHARED_DECODE), a prompt
        # also holds a table per loop but the last, under the key (request id, loop), until
        # its last position finishes its last loop; those blocks are then freed.
        self.table_planes = table_planes
        self.speculation = speculation
        # Self-speculation: a speculating request decodes in this many lanes, the slots
        # slot + j * max_num_seqs (see worker/spec_lanes.py), every pass.
        self.lanes_per_request = lanes_per_request
        self.last_drafting_round = 0  # the latest schedule that let lanes draft
        self.num_drafted = 0  # draft tokens verified
        self.num_accepted = 0  # of them, accepted
        # accepted_at[i]: accepted drafts made i + 1 tokens ahead of the verified one
        self.accepted_at = [0] * (lanes_per_request - 1)
        self.waiting: deque[Request] = deque()
        self.running: dict[int, Request] = {}
        self.free_slots: list[int] = list(range(config.max_num_seqs - 1, -1, -1))
        self.requests: dict[str, Request] = {}
        self.round = 0  # schedule() calls so far
        self.num_preemptions = 0
        self.block_updates: list[tuple[int, int, int]] = []
        # Admission leaves this many blocks free: running requests' next tokens take them,
        # so a burst of admissions does not preempt at once.
        self.watermark_blocks = max(1, kv.num_blocks // 100)
        self.by_priority = config.scheduling_policy == "priority"
        self.cache_salt = cache_salt  # what else shapes a block's K/V: model, layout, dtype
        self.known = KnownBlocks(kv, cache_salt, table_planes, self.chunk_limit, seeded_prefixes)
        self.prefix_queries = 0  # prompt tokens looked up in the prefix cache
        self.prefix_hits = 0  # of them, found
        self._sequence = 0
        self._admissions = 0  # every placement gets its own number (see _owner)

    # ----------------------------------------------------------------- request lifecycle
    def add_request(self, request: Request) -> None:
        request.sequence = self._sequence
        self._sequence += 1
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def finish(self, request: Request, reason: str) -> None:
        """Release the request's slot and blocks; safe to call in any phase."""
        if request.is_finished:
            return
        if request.status is RequestStatus.WAITING:
            self.waiting.remove(request)
        else:
            self._release(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        del self.requests[request.request_id]

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ----------------------------------------------------------------- one pass
    def schedule(self) -> SchedulerOutput:
        """Blocks first (decode rows, then new prefill chunks in rank order, preempting
        the lowest-ranked requests when the pool runs dry), then the pass's rows from what
        still runs."""
        self.round += 1
        self.block_updates: list[tuple[int, int, int]] = []
        # Speculation lanes come back before blocks and the row budget are counted.
        drafting = self._drafting()
        if drafting:
            self.last_drafting_round = self.round
            for request in self.running.values():
                if request.status is RequestStatus.DECODE:
                    request.lanes_collapsed = False
        self._reserve_decode_blocks()
        new_slots = self._admit()
        self._start_chunks()

        decoding = [r for r in self.running.values() if r.status is RequestStatus.DECODE]
        if self.config.mode == "no_refill" and any(r.token_in_flight for r in decoding):
            decoding = [r for r in decoding if r.token_in_flight]
        decoding.sort(key=attrgetter("slot"))
        # +1: with asynchronous scheduling the device may be one token ahead of this view
        # (and speculation lanes as many positions ahead as there are lanes), but never
        # past the request's last position: lanes draft no further, and the block table
        # has no column beyond it.
        max_context = 0
        rows: list[tuple[int, Request]] = []
        for request in decoding:
            lanes = self._decode_rows(request)
            reach = min(request.context_len + lanes, request.reserved_positions)
            max_context = max(max_context, reach)
            if lanes == 1:
                rows.append((request.slot, request))  # type: ignore[arg-type]
            else:
                rows.extend((slot, request) for slot in self._row_slots(request))
        prefilling = [r for r in self.running.values() if r.status is RequestStatus.PREFILL]
        chunks = [r.prefill_chunk() for r in sorted(prefilling, key=self._rank) if r.chunk_len]
        for chunk in chunks:
            self._advance_chunk(self.running[chunk.slot])
        for chunk in chunks:
            max_context = max(max_context, chunk.start + len(chunk.token_ids))
        return SchedulerOutput(
            new_slots=tuple(new for new in new_slots if new.slot in self.running),
            decode_slots=tuple(slot for slot, _ in rows),
            decode_request_ids=tuple(r.request_id for _, r in rows),
            decode_admissions=tuple(r.admission for _, r in rows),
            speculating=any(self._decode_rows(r) > 1 for r in decoding),
            drafting=drafting,
            round=self.round,
            prefill_chunks=tuple(chunks),
            max_context=max_context,
            block_updates=tuple(self.block_updates),
        )

    def _start_chunks(self) -> None:
        """Start the next chunk of prefilling requests, in rank order, while the row budget
        and the chunk limit allow and blocks can be had. Every decoding request counts one
        row, even one idling until its no_refill cohort restarts, so a chunk started now
        still fits when the cohort does."""
        rows = chunks = 0
        waiting = []
        for request in self.running.values():
            if request.status is RequestStatus.DECODE:
                rows += self._decode_rows(request)
            elif request.status is RequestStatus.PREFILL:
                if request.chunk_len:
                    rows += request.chunk_len
                    chunks += 1
                else:
                    waiting.append(request)
        budget = self.config.max_num_batched_tokens
        for request in sorted(waiting, key=self._rank):
            if request.slot is None:
                continue  # preempted for a request ranked above it
            if chunks >= self.config.max_prefill_batches_before_decode or rows >= budget:
                return
            end, depth, replayed = request.prefill_segment(request.num_prefilled)
            # SHARED_DECODE replays decode tokens as they ran: one position after another.
            limit = 1 if replayed and self.table_planes > 1 else self.chunk_limit
            length = min(limit, end - request.num_prefilled, budget - rows)
            if not self._reserve(request, request.num_prefilled + length, preempt_own=False):
                return  # it waits for blocks, and so does everything ranked below it
            request.chunk_start, request.chunk_len = request.num_prefilled, length
            request.chunk_loop, request.chunk_depth = 0, depth
            rows += length
            chunks += 1
        # Preemptions above removed rows only, so the budget still holds.

    def _decode_rows(self, request: Request) -> int:
        """Rows a decoding request takes in every pass: one, or one per speculation lane."""
        if request.speculates and not request.lanes_collapsed:
            return self.lanes_per_request
        return 1

    def _row_slots(self, request: Request) -> list[int]:
        slot = request.slot
        assert slot is not None
        return [slot + j * self.config.max_num_seqs for j in range(self._decode_rows(request))]

    def _drafting(self) -> bool:
        """Lanes draft in this pass unless more than `disable_by_batch_size` requests run
        (speculation costs rows, and pays only at low load)."""
        limit = self.speculation.batch_limit if self.speculation else None
        return self.speculation is not None and (limit is None or len(self.running) <= limit)

    # ----------------------------------------------------------------- blocks
    def _rank(self, request: Request) -> tuple[int, float, int]:
        """Who runs and keeps blocks first: lower priority value (under the priority
        policy), then earlier arrival."""
        priority = request.params.priority if self.by_priority else 0
        return (priority, request.arrival_time, request.sequence)

    def _reserve_decode_blocks(self) -> None:
        """Every decoding request gets the block of the position it may write next (one
        ahead: the device may be a token ahead of this view), preempting the lowest-ranked
        running requests when the pool runs dry, itself last."""
        # Most steps stay within a request's last block: only the requests that lack blocks
        # are ranked (one that lacks none can take nothing and preempt no one).
        short = []
        held = self.kv.positions_held
        for request in self.running.values():
            if request.status is RequestStatus.DECODE:
                # Speculation lanes may run as many positions ahead as there are lanes.
                needed = min(
                    request.context_len + self._decode_rows(request), request.reserved_positions
                )
                if needed > held(request.request_id):
                    short.append((request, needed))
        for request, needed in sorted(short, key=lambda entry: self._rank(entry[0])):
            if request.slot is None:
                continue  # preempted for a request ranked above it
            self._reserve(request, needed, preempt_own=True)

    def _reserve(self, request: Request, num_positions: int, preempt_own: bool) -> bool:
        """Blocks for `num_positions` positions of `request`, preempting running requests
        ranked below it while they lack; with `preempt_own`, the request itself when none
        is left below it. False if it got none (and, with `preempt_own`, lost its slot)."""
        tables = self._tables_to_grow(request, num_positions)
        while sum(self.kv.missing(key, n) for key, _, n in tables) > self.kv.num_free_blocks:
            if not self._preempt_one_below(request):
                if preempt_own:
                    self._preempt(request)
                return False
        for key, row, n in tables:
            for index, block in self.kv.grow(key, n):
                self.block_updates.append((row, index, block))
        return True

    def _tables_to_grow(self, request: Request, num_positions: int):
        """(block-table key, device table row, positions) of every table that must hold
        `num_positions` positions: the request's own, and while its prompt prefills under
        SHARED_DECODE, one per loop but the last for the prompt positions among them."""
        slot, planes = request.slot, self.table_planes
        assert slot is not None
        tables = [(request.request_id, slot * planes + planes - 1, num_positions)]
        if planes > 1 and request.num_prefilled < request.prompt_len:
            prompt = min(num_positions, request.prompt_len)
            tables += [
                ((request.request_id, loop), slot * planes + loop, prompt)
                for loop in range(planes - 1)
            ]
        return tables

    def _free_prompt_planes(self, request: Request) -> None:
        for loop in range(self.table_planes - 1):
            self.kv.free((request.request_id, loop))

    def _preempt_one_below(self, request: Request) -> bool:
        """Preempt the lowest-ranked running request ranked below `request`; False if none is."""
        rank = self._rank(request)
        below = [r for r in self.running.values() if self._rank(r) > rank]
        if not below:
            return False
        self._preempt(max(below, key=self._rank))
        return True

    def _release(self, request: Request) -> None:
        """Give back a running request's slot and blocks, and drop the block updates this
        round queued for that slot: the slot may go to another request in the same round."""
        slot = request.slot
        assert slot is not None
        del self.running[slot]
        self.free_slots.append(slot)
        self.kv.free(request.request_id)
        self._free_prompt_planes(request)
        request.slot = None
        rows = range(slot * self.table_planes, (slot + 1) * self.table_planes)
        if any(update[0] in rows for update in self.block_updates):
            self.block_updates = [u for u in self.block_updates if u[0] not in rows]

    def _preempt(self, request: Request) -> None:
        """Give back its slot and every block; it waits at the head of the queue and, once
        admitted again, recomputes its prompt and its generated tokens exactly (see
        `Request.plan_prefill`). A pass in flight may still hold rows of it: their results
        are dropped (it no longer owns that slot), their writes precede in stream order
        every pass that hands its blocks to another request."""
        self._release(request)
        request.status = RequestStatus.WAITING
        request.num_prefilled = request.chunk_start = request.chunk_len = 0
        request.chunk_loop = request.chunk_depth = 0
        request.token_in_flight = False
        request.preempted_in = self.round
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def _advance_chunk(self, request: Request) -> None:
        """Prefill progress is known in advance, so it moves when a loop is scheduled: the
        next pass can be planned before this one's results come back. So do the prompt
        blocks it completes enter the prefix cache: whoever finds them runs in a later pass,
        after this one's writes."""
        request.chunk_loop += 1
        if request.chunk_loop == request.chunk_depth:
            request.num_prefilled = request.chunk_start + request.chunk_len
            request.chunk_len = 0
            if self.known.caches_prompts:
                self.known.register(request)
            if request.num_prefilled >= request.prompt_len:
                # Its last loop reads and writes the final plane only, so the per-loop
                # planes may go to a request scheduled after this pass (stream order).
                self._free_prompt_planes(request)
            if request.num_prefilled == request.prefill_len:
                request.status = RequestStatus.DECODE

    def _admit(self) -> list[NewSlot]:
        """FIFO admission with a bounded scan; a blocked request is bypassed a bounded number
        of times, after which nothing behind it is admitted until it fits. A request needs
        the blocks of its first chunk beside the watermark kept for running requests' next
        tokens; one preempted in this round waits for the next (a pass in flight may still
        carry its rows)."""
        admitted: list[NewSlot] = []
        blocked: list[Request] = []
        promised = 0  # first-chunk blocks of the requests admitted in this scan
        queue = sorted(self.waiting, key=self._rank) if self.by_priority else list(self.waiting)
        if self.by_priority and queue:
            self._make_room(queue[0])
        for request in queue[: self.config.admission_scan]:
            if not self.free_slots:
                break
            if self.known.awaits_reads(request):
                continue  # its prompt blocks read early are still on their way
            hits = self.known.hits(request)
            first = self._first_chunk_blocks(request, hits)
            fits = promised + first + self._watermark() <= self.kv.num_free_blocks
            if not fits or request.preempted_in == self.round:
                if request.bypass_count >= self.config.max_admission_bypasses:
                    break
                blocked.append(request)
                continue
            if any(b.bypass_count >= self.config.max_admission_bypasses for b in blocked):
                break
            for earlier in blocked:
                earlier.bypass_count += 1
            if request.kv_import is None:  # an import takes its blocks as it is placed
                promised += first
            admitted.append(self._place(request, hits))
        return admitted

    def _watermark(self) -> int:
        """Blocks admission leaves for running requests' next tokens (none when nothing
        runs: a request that needs the whole pool must still start)."""
        return self.watermark_blocks if self.running else 0

    def _make_room(self, request: Request) -> None:
        """Priority policy: preempt running requests ranked below `request`, lowest first,
        until it has a slot and its first chunk's blocks (its cached prompt blocks need none)."""
        if request.preempted_in == self.round or self.known.awaits_reads(request):
            return
        first = self._first_chunk_blocks(request, self.known.hits(request))
        while not self.free_slots or first + self._watermark() > self.kv.num_free_blocks:
            if not self._preempt_one_below(request):
                return

    def _first_chunk_blocks(self, request: Request, hits: int) -> int:
        return self.known.first_chunk_blocks(request, hits, self._decode_rows(request))

    def _place(self, request: Request, hits: int) -> NewSlot:
        """Give `request` a slot, starting its table with its first `hits` cached blocks."""
        self.waiting.remove(request)
        slot = self.free_slots.pop()
        request.slot = slot
        # Admission leaves only the request's own lane working (see worker/spec_lanes.py).
        request.lanes_collapsed = True
        request.status = RequestStatus.PREFILL
        self._admissions += 1
        request.admission = self._admissions
        request.plan_prefill(self.num_loops)
        self.running[slot] = request
        imported, blocks = request.kv_import, ()
        taken = self.known.take(request, hits, (slot + 1) * self.table_planes - 1)
        if taken is not None:  # its table starts with them (the final plane's row)
            self.block_updates += taken
            self.prefix_queries += request.prompt_len
            self.prefix_hits += request.num_prefilled
        if imported is not None:
            request.kv_import = None  # a later preemption recomputes it, as any other
            request.num_prefilled = request.prefill_len
            request.status = RequestStatus.DECODE
            # It decodes from this pass on, as it would have on its prefill core: its lanes
            # draft whenever this round does.
            request.lanes_collapsed = self.last_drafting_round != self.round
            rows = self._decode_rows(request)
            placed = self._reserve(request, self.known.imported_positions(request, rows), False)
            assert placed, "admission counted these blocks"
            blocks = tuple(self.kv.block_table(request.request_id))
        params = request.params
        resumed = bool(request.output_token_ids)
        sampling = request.sampling
        return NewSlot(
            slot=slot,
            request_id=request.request_id,
            prompt_len=request.prefill_len,
            sampling=sampling,
            first_token=request.output_token_ids[-1] if resumed else -1,
            num_generated=len(request.output_token_ids),
            output_token_ids=tuple(request.output_token_ids) if sampling.penalties else (),
            speculates=request.speculates,
            last_position=request.prompt_len + params.max_tokens - 2,
            imported_kv=imported,
            imported_blocks=blocks,
            imported_from=hits * self.kv.block_size if imported is not None else 0,
        )

    # ----------------------------------------------------------------- results
    def update(self, output: SchedulerOutput, result: ModelRunnerOutput) -> list[Request]:
        """Record a pass's tokens; returns the requests that received one.

        Results are matched to the request that owned the slot when the pass was scheduled:
        one that finished or was aborted meanwhile is skipped, even if its slot was reused.
        """
        owners = output.owners()
        for slot in result.decode_slots_continuing:
            request = self._owner(owners, slot)
            if request is not None:
                request.token_in_flight = True
        for values in result.prompt_logprobs:
            request = self._owner(owners, values.slot)
            if request is not None:
                entries = zip(values.logprobs, values.ranks, values.top, strict=True)
                for offset, entry in enumerate(entries):
                    request.prompt_logprob_values[values.start + offset] = entry
        touched = []
        for sampled in result.sampled:
            request = self._owner(owners, sampled.slot)
            if request is None or request.stop_reason is not None:
                continue  # gone, or a token before this one in the pass ended it
            request.token_in_flight = False
            request.output_token_ids.append(sampled.token_id)
            request.exit_depths.append(sampled.exit_depth)
            request.logprobs.append(sampled.logprob)
            request.ranks.append(sampled.rank)
            request.top_logprobs.append(sampled.top_logprobs)
            request.stop_reason = token_stop(request)
            touched.append(request)
            if request.speculates and not sampled.accepted:
                # The next position restarted in the request's own lane and every other
                # lane stopped; with no draft since, that lane works alone.
                if self.last_drafting_round < output.round:
                    request.lanes_collapsed = True
            if sampled.drafted:
                self.num_drafted += 1
                if sampled.accepted:
                    self.num_accepted += 1
                    if 0 < sampled.ahead <= len(self.accepted_at):
                        self.accepted_at[sampled.ahead - 1] += 1
        return touched

    def requests_in_failed_pass(self, output: SchedulerOutput) -> list[Request]:
        """The requests that still own rows of a pass that failed, each once. The prompt
        blocks that only they hold leave the prefix cache: they were registered when the
        pass was scheduled, and it may not have written them."""
        owners = output.owners()
        found = (self._owner(owners, slot) for slot in owners)
        requests = list({r.request_id: r for r in found if r is not None}.values())
        for request in requests:
            self.kv.uncache_private(request.request_id)
        return requests

    def _owner(self, owners: dict[int, tuple[str, int]], slot: int) -> Request | None:
        request_id, admission = owners.get(slot, ("", -1))
        request = self.requests.get(request_id)
        own_slot = slot % self.config.max_num_seqs  # of a speculation lane, its request's
        if request is None or request.slot != own_slot or request.admission != admission:
            return None
        return request
