"""Loop-level continuous batching: admission, the rows of each pass, and block reservation."""

from __future__ import annotations

from collections import deque

from vllm_rlt.config import SchedulerConfig
from vllm_rlt.core.block_pool import KVCacheManager
from vllm_rlt.core.contract import (
    ModelRunnerOutput,
    NewSlot,
    PrefillChunk,
    SchedulerOutput,
)
from vllm_rlt.core.request import Request, RequestStatus


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
    ) -> None:
        self.config = config
        self.kv = kv
        self.num_loops = num_loops
        # SHARED layout: a position must finish every loop before the next one starts.
        self.chunk_limit = 1 if one_position_prefill else config.prefill_chunk_size
        self.waiting: deque[Request] = deque()
        self.running: dict[int, Request] = {}
        self.free_slots: list[int] = list(range(config.max_num_seqs - 1, -1, -1))
        self.requests: dict[str, Request] = {}

    # ----------------------------------------------------------------- request lifecycle
    def add_request(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def finish(self, request: Request, reason: str) -> None:
        """Release the request's slot and blocks; safe to call in any phase."""
        if request.is_finished:
            return
        if request.status is RequestStatus.WAITING:
            self.waiting.remove(request)
        else:
            assert request.slot is not None
            del self.running[request.slot]
            self.free_slots.append(request.slot)
            self.kv.free(request.request_id)
            request.slot = None
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        del self.requests[request.request_id]

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ----------------------------------------------------------------- one pass
    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        decoding = [r for r in self.running.values() if r.status is RequestStatus.DECODE]
        # Budget one row for every decoding request, even one idling until its no_refill
        # cohort restarts, so a prefill chunk started now still fits when the cohort does.
        rows = len(decoding)
        in_flight = [r for r in decoding if r.token_in_flight]
        if self.config.mode == "no_refill" and in_flight:
            decoding = in_flight
        decoding.sort(key=lambda r: r.slot)  # type: ignore[arg-type, return-value]
        # +1: with asynchronous scheduling the device may be one token ahead of this view.
        max_context = max((r.context_len + 1 for r in decoding), default=0)

        chunks: list[PrefillChunk] = []
        prefilling = [r for r in self.running.values() if r.status is RequestStatus.PREFILL]
        for request in prefilling:
            if request.chunk_len:
                chunks.append(self._chunk(request))
                rows += request.chunk_len

        new_slots = self._admit()
        prefilling = [r for r in self.running.values() if r.status is RequestStatus.PREFILL]
        prefilling.sort(key=lambda r: r.arrival_time)
        for request in prefilling:
            if request.chunk_len:
                continue
            if len(chunks) >= self.config.max_prefill_batches_before_decode or rows >= budget:
                break
            length = min(
                self.chunk_limit, request.prompt_len - request.num_prefilled, budget - rows
            )
            request.chunk_start, request.chunk_len, request.chunk_loop = (
                request.num_prefilled,
                length,
                0,
            )
            chunks.append(self._chunk(request))
            rows += length
        for chunk in chunks:
            max_context = max(max_context, chunk.start + len(chunk.token_ids))
            self._advance_chunk(self.running[chunk.slot])
        return SchedulerOutput(
            new_slots=tuple(new_slots),
            decode_slots=tuple(r.slot for r in decoding),  # type: ignore[misc]
            decode_request_ids=tuple(r.request_id for r in decoding),
            prefill_chunks=tuple(chunks),
            max_context=max_context,
        )

    def _advance_chunk(self, request: Request) -> None:
        """Prefill progress is known in advance, so it moves when a loop is scheduled: the
        next pass can be planned before this one's results come back."""
        request.chunk_loop += 1
        if request.chunk_loop == self.num_loops:
            request.num_prefilled = request.chunk_start + request.chunk_len
            request.chunk_len = 0
            if request.num_prefilled == request.prompt_len:
                request.status = RequestStatus.DECODE

    def _chunk(self, request: Request) -> PrefillChunk:
        start, length = request.chunk_start, request.chunk_len
        last = start + length == request.prompt_len and request.chunk_loop == self.num_loops - 1
        return PrefillChunk(
            slot=request.slot,  # type: ignore[arg-type]
            request_id=request.request_id,
            start=start,
            token_ids=tuple(request.prompt_token_ids[start : start + length]),
            loop=request.chunk_loop,
            samples=last,
        )

    def _admit(self) -> list[NewSlot]:
        """FIFO admission with a bounded scan; a blocked request is bypassed a bounded number
        of times, after which nothing behind it is admitted until it fits."""
        admitted: list[NewSlot] = []
        blocked: list[Request] = []
        for request in list(self.waiting)[: self.config.admission_scan_limit]:
            if not self.free_slots:
                break
            if not self.kv.can_allocate(request.reserved_positions):
                if request.bypass_count >= self.config.max_admission_bypasses:
                    break
                blocked.append(request)
                continue
            if any(b.bypass_count >= self.config.max_admission_bypasses for b in blocked):
                break
            for earlier in blocked:
                earlier.bypass_count += 1
            admitted.append(self._place(request))
        return admitted

    def _place(self, request: Request) -> NewSlot:
        self.waiting.remove(request)
        slot = self.free_slots.pop()
        blocks = self.kv.allocate(request.request_id, request.reserved_positions)
        request.slot = slot
        request.status = RequestStatus.PREFILL
        self.running[slot] = request
        params = request.params
        return NewSlot(
            slot=slot,
            block_ids=tuple(blocks),
            prompt_len=request.prompt_len,
            min_loops=request.min_loops,
            max_loops=request.max_loops,
            exit_threshold=request.exit_threshold,
            temperature=params.temperature,
            top_k=params.top_k,
            top_p=params.top_p,
            min_p=params.min_p,
            seed=request.seed,
            min_tokens=params.min_tokens,
            num_logprobs=params.logprobs or 0,
            banned_until_min_tokens=tuple(request_banned_ids(request)),
            decode_depths=request.decode_depths,
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
        touched = []
        for sampled in result.sampled:
            request = self._owner(owners, sampled.slot)
            if request is None:
                continue
            request.token_in_flight = False
            request.output_token_ids.append(sampled.token_id)
            request.exit_depths.append(sampled.exit_depth)
            request.logprobs.append(sampled.logprob)
            request.top_logprobs.append(sampled.top_logprobs)
            touched.append(request)
        return touched

    def _owner(self, owners: dict[int, str], slot: int) -> Request | None:
        request = self.requests.get(owners.get(slot, ""))
        return request if request is not None and request.slot == slot else None


def request_banned_ids(request: Request) -> list[int]:
    """Token ids that may not be sampled before min_tokens: stop ids, and EOS unless ignored."""
    return sorted(set(request.params.stop_token_ids) | set(request.eos_token_ids))
