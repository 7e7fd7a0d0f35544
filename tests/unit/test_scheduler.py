"""Scheduler alone, with a fake runner: row budget, admission, prefill chunking, no_refill."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest

from vllm_rlt.config import SchedulerConfig
from vllm_rlt.core.contract import ModelRunnerOutput, SampledToken, SchedulerOutput
from vllm_rlt.core.kv_cache_manager import KVCacheManager
from vllm_rlt.core.request import Request, RequestStatus
from vllm_rlt.core.scheduler import Scheduler
from vllm_rlt.sampling_params import SamplingParams

T = 4
Depth = Callable[[Request, int], int]


def make_request(request_id: str, prompt_len: int, max_tokens: int, arrival: float = 0.0):
    return Request(
        request_id=request_id,
        prompt_token_ids=[3 + i % 200 for i in range(prompt_len)],
        params=SamplingParams(max_tokens=max_tokens, temperature=0.0),
        min_loops=1,
        max_loops=T,
        exit_threshold=1.0,
        seed=0,
        arrival_time=arrival,
    )


def make_scheduler(
    num_blocks: int = 64,
    block_size: int = 4,
    one_position_prefill: bool = False,
    enable_caching: bool = False,
    table_planes: int = 1,
    **config,
) -> Scheduler:
    kv = KVCacheManager(num_blocks, block_size, enable_caching)
    config.setdefault("max_num_seqs", 4)
    config.setdefault("max_num_batched_tokens", 2048)
    config.setdefault("max_prefill_batches_before_decode", 4)
    return Scheduler(
        SchedulerConfig(**config),
        kv,
        num_loops=T,
        one_position_prefill=one_position_prefill,
        table_planes=table_planes,
    )


class FakeRunner:
    """Plays the model runner: a decode token exits after `depth(request, index)` loops, and a
    prompt samples its first token when its last chunk finishes loop T."""

    def __init__(self, scheduler: Scheduler, depth: Depth = lambda request, index: T) -> None:
        self.scheduler = scheduler
        self.depth = depth
        self.loops: dict[int, int] = {}

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        for new in out.new_slots:
            self.loops[new.slot] = 0
        sampled, continuing = [], []
        for slot in out.decode_slots:
            request = self.scheduler.running[slot]
            self.loops[slot] += 1
            if self.loops[slot] >= self.depth(request, len(request.output_token_ids)):
                sampled.append(SampledToken(slot, 7, self.loops[slot], 0.0, ()))
                self.loops[slot] = 0
            else:
                continuing.append(slot)
        for chunk in out.prefill_chunks:
            if chunk.samples:
                sampled.append(SampledToken(chunk.slot, 7, T, 0.0, ()))
        return ModelRunnerOutput(tuple(sampled), tuple(continuing))


def step(scheduler: Scheduler, runner: FakeRunner) -> SchedulerOutput:
    """One engine step: schedule, execute, update, and finish requests at max_tokens."""
    out = scheduler.schedule()
    result = runner.execute(out)
    for request in scheduler.update(out, result):
        if len(request.output_token_ids) >= request.params.max_tokens:
            scheduler.finish(request, "length")
    return out


def run_all(
    scheduler: Scheduler,
    runner: FakeRunner,
    arrivals: dict[int, list[Request]] | None = None,
    max_steps: int = 5000,
) -> list[SchedulerOutput]:
    """Step until idle, adding requests at the given pass numbers; returns every pass."""
    arrivals = dict(arrivals or {})
    passes = []
    while arrivals or scheduler.has_unfinished:
        for request in arrivals.pop(len(passes), []):
            scheduler.add_request(request)
        passes.append(step(scheduler, runner))
        assert len(passes) < max_steps, "scheduler did not drain"
    return passes


def assert_idle(scheduler: Scheduler) -> None:
    assert scheduler.kv.all_free()
    assert not scheduler.running and not scheduler.waiting and not scheduler.requests
    assert sorted(scheduler.free_slots) == list(range(scheduler.config.max_num_seqs))


def random_workload(seed: int, count: int) -> tuple[dict[int, list[Request]], Depth]:
    rng = random.Random(seed)
    arrivals: dict[int, list[Request]] = {}
    for i in range(count):
        request = make_request(f"r{i}", rng.randint(1, 13), rng.randint(1, 9), arrival=i)
        arrivals.setdefault(rng.randrange(0, 40), []).append(request)
    depths: dict[tuple[str, int], int] = {}

    def depth(request: Request, index: int) -> int:
        return depths.setdefault((request.request_id, index), rng.randint(1, T))

    return arrivals, depth


@pytest.mark.parametrize("mode", ["refill", "no_refill"])
@pytest.mark.parametrize("seed", range(4))
def test_rows_per_pass_never_exceed_budget(mode, seed):
    """max_num_batched_tokens is a hard bound on one pass, whatever mix of exits happens."""
    scheduler = make_scheduler(
        mode=mode, max_num_seqs=4, max_num_batched_tokens=6, prefill_chunk_size=5
    )
    arrivals, depth = random_workload(seed, 10)
    passes = run_all(scheduler, FakeRunner(scheduler, depth), arrivals)
    rows = [out.num_rows for out in passes]
    assert max(rows) <= 6, f"pass rows {rows}"
    assert max(rows) == 6  # the budget was actually reached, so the bound was exercised
    assert all(len(c.token_ids) <= 5 for out in passes for c in out.prefill_chunks)
    assert all(len(out.decode_slots) <= 4 for out in passes)
    assert_idle(scheduler)


def test_no_refill_cohort_restart_keeps_budget():
    """A no_refill cohort restarting all its tokens at once must not push a pass, together with
    a prefill chunk started while only one token was in flight, over the row budget."""
    scheduler = make_scheduler(
        mode="no_refill", max_num_seqs=3, max_num_batched_tokens=4, prefill_chunk_size=8
    )
    fast, slow = make_request("fast", 1, 6, 0), make_request("slow", 1, 6, 1)
    late = make_request("late", 8, 2, 2)
    runner = FakeRunner(scheduler, lambda request, index: 1 if request is fast else T)
    passes = run_all(scheduler, runner, {0: [fast, slow], 9: [late]})
    rows = [out.num_rows for out in passes]
    assert max(rows) <= 4, f"pass rows {rows}"
    assert_idle(scheduler)


def test_max_num_seqs_bounds_running():
    """At most max_num_seqs requests hold a slot; the rest wait and are admitted later."""
    scheduler = make_scheduler(max_num_seqs=2, max_num_batched_tokens=16)
    runner = FakeRunner(scheduler)
    for i in range(5):
        scheduler.add_request(make_request(f"r{i}", 3, 3, arrival=i))
    peak, saw_waiting = 0, False
    while scheduler.has_unfinished:
        step(scheduler, runner)
        peak = max(peak, len(scheduler.running))
        saw_waiting |= bool(scheduler.waiting) and len(scheduler.running) == 2
        assert len(scheduler.running) <= 2
    assert peak == 2 and saw_waiting
    assert_idle(scheduler)


def _blocked_setup(max_admission_bypasses: int, **config) -> tuple[Scheduler, FakeRunner]:
    """12 blocks of 4: a running request holds 8, so a request whose first chunk needs 5
    is blocked while 1-block requests still fit (with the 1-block watermark, 3 of them)."""
    scheduler = make_scheduler(
        num_blocks=12,
        block_size=4,
        max_num_seqs=8,
        max_admission_bypasses=max_admission_bypasses,
        **config,
    )
    runner = FakeRunner(scheduler)
    holder = make_request("holder", 32, 1, arrival=0)  # 32 prompt positions = 8 blocks
    scheduler.add_request(holder)
    step(scheduler, runner)
    assert scheduler.kv.num_free_blocks == 4
    return scheduler, runner


def test_short_request_bypasses_blocked_long_one():
    """A blocked long request does not stall short ones behind it while bypasses remain."""
    scheduler, runner = _blocked_setup(max_admission_bypasses=8)
    long = make_request("long", 20, 1, arrival=1)  # a 20-position prompt = 5 blocks
    short = make_request("short", 2, 2, arrival=2)
    scheduler.add_request(long)
    scheduler.add_request(short)
    out = step(scheduler, runner)
    assert [scheduler.running[s.slot].request_id for s in out.new_slots] == ["short"]
    assert long.status is RequestStatus.WAITING and long.bypass_count == 1
    run_all(scheduler, runner)
    assert_idle(scheduler)


def test_bypass_limit_across_passes():
    """Once the long request was bypassed max_admission_bypasses times, later requests wait."""
    scheduler, runner = _blocked_setup(max_admission_bypasses=2)
    long = make_request("long", 20, 1, arrival=1)
    scheduler.add_request(long)
    admitted = []
    for i in range(3):
        scheduler.add_request(make_request(f"s{i}", 2, 2, arrival=2 + i))
        out = step(scheduler, runner)
        admitted += [scheduler.running[s.slot].request_id for s in out.new_slots]
    assert admitted == ["s0", "s1"] and long.bypass_count == 2
    assert scheduler.requests["s2"].status is RequestStatus.WAITING
    assert [r.request_id for r in scheduler.waiting] == ["long", "s2"]
    run_all(scheduler, runner)
    assert_idle(scheduler)


def test_bypass_limit_within_one_scan():
    """The bound also holds when several short requests are scanned in the same pass: with
    max_admission_bypasses=2, only two of four fitting short requests may pass the long one."""
    scheduler, runner = _blocked_setup(max_admission_bypasses=2)
    long = make_request("long", 20, 1, arrival=1)
    shorts = [make_request(f"s{i}", 2, 2, arrival=2 + i) for i in range(4)]
    for request in [long, *shorts]:
        scheduler.add_request(request)
    out = step(scheduler, runner)
    admitted = sorted(scheduler.running[s.slot].request_id for s in out.new_slots)
    assert admitted == ["s0", "s1"], f"admitted past the blocked request: {admitted}"
    assert long.bypass_count <= 2
    run_all(scheduler, runner)
    assert_idle(scheduler)


def test_zero_bypasses_is_strict_fifo():
    scheduler, runner = _blocked_setup(max_admission_bypasses=0)
    scheduler.add_request(make_request("long", 20, 1, arrival=1))
    scheduler.add_request(make_request("short", 2, 2, arrival=2))
    out = step(scheduler, runner)
    assert not out.new_slots
    assert [r.request_id for r in scheduler.waiting] == ["long", "short"]
    run_all(scheduler, runner)
    assert_idle(scheduler)


def test_admission_scan_limit_bounds_the_scan():
    """Requests beyond admission_scan_limit are not looked at this pass even if they fit."""
    scheduler, runner = _blocked_setup(max_admission_bypasses=8, admission_scan_limit=2)
    scheduler.add_request(make_request("long", 20, 1, arrival=1))
    scheduler.add_request(make_request("s0", 2, 2, arrival=2))
    scheduler.add_request(make_request("s1", 2, 2, arrival=3))
    out = step(scheduler, runner)
    assert [scheduler.running[s.slot].request_id for s in out.new_slots] == ["s0"]
    assert [r.request_id for r in scheduler.waiting] == ["long", "s1"]
    out = step(scheduler, runner)  # s0 gone from the queue, so s1 is within the window now
    assert [scheduler.running[s.slot].request_id for s in out.new_slots] == ["s1"]
    run_all(scheduler, runner)
    assert_idle(scheduler)


@pytest.mark.parametrize(("scan", "admitted"), [(None, 64), (100, 100)])
def test_a_burst_is_admitted_as_deep_as_the_scan(scan, admitted):
    """A burst of 100 fitting requests: one pass admits as many as the scan looks at (64
    unless sized or set), and starts a chunk for each within the chunk limit."""
    scheduler = make_scheduler(
        num_blocks=512,
        max_num_seqs=128,
        max_prefill_batches_before_decode=100,
        admission_scan_limit=scan,
    )
    for i in range(100):
        scheduler.add_request(make_request(f"r{i}", 4, 1, arrival=i))
    out = scheduler.schedule()
    assert len(out.new_slots) == len(out.prefill_chunks) == admitted


def _chunks_of(passes: list[SchedulerOutput], slot: int) -> list[tuple[int, int, int, bool]]:
    return [
        (c.start, len(c.token_ids), c.loop, c.samples)
        for out in passes
        for c in out.prefill_chunks
        if c.slot == slot
    ]


def test_prefill_chunks_run_every_loop_before_the_next_chunk():
    """Chunks are at most prefill_chunk_size, each runs loops 0..T-1, and only the last
    chunk's last loop samples."""
    scheduler = make_scheduler(prefill_chunk_size=4, max_num_batched_tokens=64)
    request = make_request("r", 10, 2)
    passes = run_all(scheduler, FakeRunner(scheduler), {0: [request]})
    slot = passes[0].new_slots[0].slot
    expected = [
        (start, length, loop, start == 8 and loop == T - 1)
        for start, length in ((0, 4), (4, 4), (8, 2))
        for loop in range(T)
    ]
    assert _chunks_of(passes, slot) == expected
    assert request.output_token_ids == [7, 7]
    assert_idle(scheduler)


def test_chunk_tokens_and_budget_split():
    """A chunk carries the prompt's own tokens and is cut to the rows left in the budget."""
    scheduler = make_scheduler(prefill_chunk_size=8, max_num_batched_tokens=5, max_num_seqs=2)
    request = make_request("r", 7, 1)
    passes = run_all(scheduler, FakeRunner(scheduler), {0: [request]})
    chunks = [c for out in passes for c in out.prefill_chunks]
    assert [(c.start, len(c.token_ids)) for c in chunks[::T]] == [(0, 5), (5, 2)]
    assert chunks[0].token_ids == tuple(request.prompt_token_ids[:5])
    assert chunks[T].token_ids == tuple(request.prompt_token_ids[5:])
    assert_idle(scheduler)


def test_max_prefill_batches_before_decode_bounds_chunks_in_flight():
    scheduler = make_scheduler(
        max_prefill_batches_before_decode=2, prefill_chunk_size=3, max_num_batched_tokens=64
    )
    arrivals = {0: [make_request(f"r{i}", 6, 2, arrival=i) for i in range(4)]}
    passes = run_all(scheduler, FakeRunner(scheduler), arrivals)
    assert len(passes[0].new_slots) == 4  # admission is not what limits the chunks
    per_pass = [len(out.prefill_chunks) for out in passes]
    assert max(per_pass) == 2, per_pass
    # The two oldest requests get their chunks first.
    first = {passes[0].new_slots[i].slot for i in range(2)}
    assert {c.slot for c in passes[0].prefill_chunks} == first
    assert_idle(scheduler)


@pytest.mark.parametrize("mode", ["refill", "no_refill"])
def test_no_refill_holds_exited_rows_until_the_cohort_finishes(mode):
    """In no_refill, a token that exited early does not start its successor while another
    token of the cohort is still looping; in refill it starts on the very next pass."""
    scheduler = make_scheduler(mode=mode, max_num_seqs=2, max_num_batched_tokens=8)
    fast, slow = make_request("fast", 1, 4, 0), make_request("slow", 1, 4, 1)
    runner = FakeRunner(scheduler, lambda request, index: 1 if request is fast else T)
    passes = run_all(scheduler, runner, {0: [fast, slow]})
    fast_slot, slow_slot = (s.slot for s in passes[0].new_slots)
    both = tuple(sorted((fast_slot, slow_slot)))
    decode = [out.decode_slots for out in passes if out.decode_slots]
    if mode == "refill":
        assert decode[:3] == [both] * 3  # fast runs its three decode tokens back to back
        assert sum(fast_slot in slots for slots in decode) == 3
    else:
        # Each cohort: both start together, then slow loops alone for T - 1 passes.
        assert decode == ([both] + [(slow_slot,)] * (T - 1)) * 3
    assert_idle(scheduler)


def test_one_position_prefill_gives_single_position_chunks():
    """The SHARED layout: each prompt position runs all loops before the next one starts."""
    scheduler = make_scheduler(
        num_blocks=16, one_position_prefill=True, prefill_chunk_size=8, max_num_batched_tokens=16
    )
    passes = run_all(scheduler, FakeRunner(scheduler), {0: [make_request("r", 3, 2)]})
    expected = [(p, 1, loop, p == 2 and loop == T - 1) for p in range(3) for loop in range(T)]
    assert _chunks_of(passes, 0) == expected
    assert_idle(scheduler)


def test_finish_frees_blocks_and_slot_in_every_phase():
    """finish() releases the blocks and the slot whether waiting, prefilling or decoding."""
    scheduler = make_scheduler(num_blocks=8, block_size=4, max_num_seqs=2, max_num_batched_tokens=8)
    runner = FakeRunner(scheduler)
    decoding, prefilling = make_request("d", 2, 8, 0), make_request("p", 8, 2, 1)
    waiting = make_request("w", 2, 2, 2)
    scheduler.add_request(decoding)
    for _ in range(T):
        step(scheduler, runner)
    assert decoding.status is RequestStatus.DECODE
    scheduler.add_request(prefilling)
    scheduler.add_request(waiting)
    step(scheduler, runner)
    assert prefilling.status is RequestStatus.PREFILL and waiting.status is RequestStatus.WAITING
    held = len(scheduler.kv.block_table("p"))
    assert held == 2  # its first chunk: 8 prompt positions (the decoder holds 1 or 2)
    free = scheduler.kv.num_free_blocks
    scheduler.finish(prefilling, "abort")
    assert scheduler.kv.num_free_blocks == free + held and len(scheduler.free_slots) == 1
    scheduler.finish(waiting, "abort")
    assert not scheduler.waiting and waiting.finish_reason == "abort"
    scheduler.finish(decoding, "abort")
    scheduler.finish(decoding, "stop")  # a second finish changes nothing
    assert decoding.finish_reason == "abort"
    assert_idle(scheduler)
    assert scheduler.schedule().is_empty


def test_shared_decode_prompt_holds_every_loop_table_until_its_last_loop():
    """SHARED_DECODE: a prefilling prompt takes a block per loop for each of its position
    blocks (table row slot * T + loop); when its last chunk is scheduled at its last loop,
    the per-loop tables are freed and only the final one (row slot * T + T - 1) grows."""
    scheduler = make_scheduler(
        num_blocks=32, table_planes=T, prefill_chunk_size=4, max_num_batched_tokens=16
    )
    runner = FakeRunner(scheduler)
    request = make_request("r", 8, 6)
    scheduler.add_request(request)
    first = step(scheduler, runner)  # chunk 1 (positions 0-3), loop 0
    slot = request.slot
    assert sorted(row for row, _, _ in first.block_updates) == [slot * T + p for p in range(T)]
    assert scheduler.kv.num_free_blocks == 32 - T
    while request.status is RequestStatus.PREFILL:
        out = step(scheduler, runner)
    # The pass that ran the prompt's last loop was scheduled after the per-loop tables went.
    assert out.prefill_chunks[0].loop == T - 1
    assert scheduler.kv.num_free_blocks == 32 - 2
    assert all(scheduler.kv.block_table(("r", loop)) == [] for loop in range(T - 1))
    updates = [u for _ in range(4 * T) for u in step(scheduler, runner).block_updates]
    assert {row for row, _, _ in updates} == {slot * T + T - 1}
    run_all(scheduler, runner)
    assert_idle(scheduler)


def test_shared_decode_replays_generated_tokens_one_position_at_a_time():
    """A preempted SHARED_DECODE request re-prefills its prompt in chunks, but its generated
    tokens one position per chunk: each read every earlier one at its final K/V."""
    scheduler = make_scheduler(
        num_blocks=64, table_planes=T, prefill_chunk_size=8, max_num_batched_tokens=16
    )
    runner = FakeRunner(scheduler)
    request = make_request("r", 3, 8)
    scheduler.add_request(request)
    while len(request.output_token_ids) < 4:
        step(scheduler, runner)
    scheduler._preempt(request)
    passes = run_all(scheduler, runner)
    chunks = [c for out in passes for c in out.prefill_chunks if c.loop == 0]
    assert [(c.start, len(c.token_ids)) for c in chunks] == [(0, 3), (3, 1), (4, 1), (5, 1)]
    assert [c.deep_writes for c in chunks] == [False, True, True, True]
    assert_idle(scheduler)


def test_priority_admission_counts_prefix_hits_before_preempting():
    """An urgent request whose prompt is mostly cached in blocks a running request holds
    needs only the blocks of its uncached tail: nothing is preempted for the rest."""
    from dataclasses import replace

    scheduler = make_scheduler(
        num_blocks=6,
        enable_caching=True,
        scheduling_policy="priority",
        prefill_chunk_size=8,
        max_num_batched_tokens=16,
    )
    runner = FakeRunner(scheduler)
    low = make_request("low", 12, 12)
    low.params = replace(low.params, priority=5)
    scheduler.add_request(low)
    while len(low.output_token_ids) < 2:
        step(scheduler, runner)
    assert scheduler.kv.num_free_blocks == 2  # 3 prompt blocks and 1 decode block held
    urgent = make_request("urgent", 12, 2, arrival=1.0)  # the same 12 prompt tokens
    scheduler.add_request(urgent)
    step(scheduler, runner)
    assert scheduler.num_preemptions == 0
    assert urgent.status is RequestStatus.PREFILL and low.status is RequestStatus.DECODE
    run_all(scheduler, runner)
    assert_idle(scheduler)


def test_token_stops_are_decided_when_tokens_arrive_and_end_the_pass_there():
    """A stop id ends the request at that token (not before min_tokens), max_tokens ends it
    with "length", and a later token of the same pass (a speculation lane's) is dropped."""
    scheduler = make_scheduler()
    request = make_request("r", 3, max_tokens=10)
    request.params = SamplingParams(max_tokens=10, min_tokens=2, stop_token_ids=[9])
    request.stop_token_ids = frozenset({9})
    scheduler.add_request(request)
    out = scheduler.schedule()
    while not out.prefill_chunks or not out.prefill_chunks[0].samples:
        scheduler.update(out, ModelRunnerOutput((), ()))
        out = scheduler.schedule()
    slot = request.slot

    def tokens(*ids: int) -> ModelRunnerOutput:
        return ModelRunnerOutput(tuple(SampledToken(slot, i, T, 0.0, ()) for i in ids), ())

    scheduler.update(out, tokens(9))  # the first token: a stop id, but min_tokens is 2
    assert request.output_token_ids == [9] and request.stop_reason is None
    out = scheduler.schedule()
    scheduler.update(out, tokens(9, 5))
    assert request.output_token_ids == [9, 9] and request.stop_reason == "stop"

    long = make_request("long", 3, max_tokens=1)
    scheduler.add_request(long)
    out = scheduler.schedule()
    while not any(c.samples and c.slot == long.slot for c in out.prefill_chunks):
        scheduler.update(out, ModelRunnerOutput((), ()))
        out = scheduler.schedule()
    scheduler.update(out, ModelRunnerOutput((SampledToken(long.slot, 4, T, 0.0, ()),), ()))
    assert long.stop_reason == "length"
