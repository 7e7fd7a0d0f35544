"""Property tests of the block pool under the scheduler: random arrivals, aborts, priorities,
prefix caching (the prompts share their first tokens) and pools small enough to preempt all
the time never leak a block, miscount a shared one, or leave work undone."""

from __future__ import annotations

from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from tests.unit.test_scheduler import FakeRunner, T, assert_idle, make_request, make_scheduler
from vllm_rlt.core.request import RequestStatus


def assert_blocks_consistent(scheduler) -> None:
    kv = scheduler.kv
    tables = kv._tables
    held = {block for table in tables.values() for block in table}
    for block in range(kv.num_blocks):
        holders = sum(table.count(block) for table in tables.values())
        assert kv._refs[block] == holders, (
            f"block {block}: {kv._refs[block]} refs, {holders} holders"
        )
    if not kv.enable_caching:
        assert all(kv._refs[b] <= 1 for b in held), "an uncached block is shared"
    free, evictable = set(kv._free), set(kv._evictable)
    assert len(free) == len(kv._free), "a block is free twice"
    assert not held & free and not held & evictable and not free & evictable
    assert len(held) + len(free) + len(evictable) == kv.num_blocks, "a block leaked"
    assert evictable <= set(kv._hash_of) and not free & set(kv._hash_of)
    assert {kv._block_of[h] for h in kv._hash_of.values()} == set(kv._hash_of)
    running = {r.request_id for r in scheduler.running.values()}
    owners = {key if isinstance(key, str) else key[0] for key in tables}
    assert owners <= running, "a request that does not run holds blocks"
    for key in tables:
        if not isinstance(key, str):  # SHARED_DECODE: a per-loop table of a prompt
            request = scheduler.requests[key[0]]
            assert request.num_prefilled < request.prompt_len, "per-loop table kept too long"
    for request in scheduler.running.values():
        assert request.status is not RequestStatus.WAITING
    for request in scheduler.waiting:
        assert request.slot is None and request.request_id not in tables


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_random_traffic_never_leaks_or_shares_a_block(data):
    block_size = data.draw(st.sampled_from([1, 2, 4]), label="block_size")
    # 1: a block table per request; T: SHARED_DECODE, a prompt also holds one per loop
    table_planes = data.draw(st.sampled_from([1, T]), label="table_planes")
    num_blocks = data.draw(st.integers(3 if table_planes == 1 else T, 24), label="num_blocks")
    policy = data.draw(st.sampled_from(["fcfs", "priority"]), label="policy")
    scheduler = make_scheduler(
        table_planes=table_planes,
        num_blocks=num_blocks,
        block_size=block_size,
        max_num_seqs=data.draw(st.integers(1, 4), label="max_num_seqs"),
        max_num_batched_tokens=16,
        prefill_chunk_size=data.draw(st.integers(1, 8), label="chunk"),
        mode=data.draw(st.sampled_from(["refill", "no_refill"]), label="mode"),
        scheduling_policy=policy,
        enable_caching=data.draw(st.booleans(), label="caching"),
    )
    rng_depths: dict[tuple[str, int], int] = {}

    def depth(request, index: int) -> int:
        key = (request.request_id, index)
        if key not in rng_depths:
            rng_depths[key] = data.draw(st.integers(1, T), label="depth")
        return rng_depths[key]

    runner = FakeRunner(scheduler, depth)
    capacity = num_blocks * block_size
    added = 0
    for _ in range(data.draw(st.integers(1, 120), label="actions")):
        action = data.draw(st.sampled_from(["add", "step", "step", "step", "abort"]))
        if action == "add":
            # as the request checks allow: the whole context, and the prompt at every loop
            prompt_cap = (num_blocks // table_planes) * block_size
            prompt_len = data.draw(st.integers(1, min(12, prompt_cap)))
            max_tokens = data.draw(st.integers(1, capacity - prompt_len + 1))
            request = make_request(f"r{added}", prompt_len, max_tokens, arrival=added)
            if policy == "priority":
                priority = data.draw(st.integers(-2, 2))
                request.params = replace(request.params, priority=priority)
            scheduler.add_request(request)
            added += 1
        elif action == "abort" and scheduler.requests:
            victim = data.draw(st.sampled_from(sorted(scheduler.requests)))
            scheduler.finish(scheduler.requests[victim], "abort")
        else:
            _step(scheduler, runner)
        assert_blocks_consistent(scheduler)
    for _ in range(20000):
        if not scheduler.has_unfinished:
            break
        _step(scheduler, runner)
        assert_blocks_consistent(scheduler)
    assert_idle(scheduler)


def _step(scheduler, runner) -> None:
    out = scheduler.schedule()
    assert not out.is_empty or not scheduler.has_unfinished, "an empty pass with work queued"
    for request in scheduler.update(out, runner.execute(out)):
        if len(request.output_token_ids) >= request.params.max_tokens:
            scheduler.finish(request, "length")
