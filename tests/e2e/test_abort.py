"""Aborting requests: blocks come back at once, and the rest of the batch is unaffected."""

from __future__ import annotations

import pytest

from tests.conftest import drain, frontend
from vllm_rlt import SamplingParams
from vllm_rlt.core.request import RequestStatus

ADAPTIVE = SamplingParams(max_tokens=8, temperature=0.0, exit_threshold=0.5, ignore_eos=True)
OTHERS = {
    "a": [20, 21, 22, 23, 24, 25, 26],
    "c": [90, 91, 92],
    "d": [150, 151, 152, 153, 154],  # waits for a slot until the victim leaves
}
VICTIM = [200 + i for i in range(12)]
ENGINE = dict(max_num_seqs=3, max_num_batched_tokens=16, prefill_chunk_size=4, block_size=4)


def _baseline(make_engine) -> dict[str, tuple[list[int], list[int]]]:
    """Tokens and depths of the other requests run without the victim."""
    engine = make_engine(**ENGINE)
    done = drain(engine, {0: [(rid, ids, ADAPTIVE) for rid, ids in OTHERS.items()]})
    return {rid: (o.outputs[0].token_ids, o.outputs[0].exit_depths) for rid, o in done.items()}


def _abort_when(
    make_engine, ready, async_scheduling: bool = False
) -> dict[str, tuple[list[int], list[int]]]:
    """Run the victim among the others, abort it as soon as `ready(request)` holds, and check
    the abort itself; returns the others' tokens and depths."""
    engine = make_engine(**ENGINE, async_scheduling=async_scheduling)
    frontend(engine).add_request("a", OTHERS["a"], ADAPTIVE)
    frontend(engine).add_request("victim", VICTIM, ADAPTIVE)
    frontend(engine).add_request("c", OTHERS["c"], ADAPTIVE)
    frontend(engine).add_request("d", OTHERS["d"], ADAPTIVE)
    victim = engine.scheduler.requests["victim"]
    finished = {}
    for _ in range(200):
        if ready(victim):
            break
        finished.update({o.request_id: o for o in frontend(engine).step() if o.finished})
    else:
        raise AssertionError("the victim never reached the state to abort in")
    assert engine.scheduler.requests["d"].status is RequestStatus.WAITING
    held = len(engine.kv.block_table("victim"))
    assert held > 0
    free_before = engine.kv.num_free_blocks
    aborted = frontend(engine).abort_request("victim")
    assert engine.kv.num_free_blocks == free_before + held
    assert aborted.finished and aborted.request_id == "victim"
    assert aborted.outputs[0].finish_reason == "abort"
    assert aborted.outputs[0].token_ids == victim.output_token_ids
    assert frontend(engine).abort_request("victim") is None  # already gone
    finished.update(drain(engine))
    assert "victim" not in finished
    return {rid: (o.outputs[0].token_ids, o.outputs[0].exit_depths) for rid, o in finished.items()}


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_abort_during_prefill(make_engine, async_scheduling):
    """Mid-prompt (a chunk in flight at a middle loop): the others run as if it never came."""

    def ready(victim):
        return (
            victim.status is RequestStatus.PREFILL
            and victim.num_prefilled >= 4
            and (victim.chunk_len and victim.chunk_loop == 2)
        )

    assert _abort_when(make_engine, ready, async_scheduling) == _baseline(make_engine)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_abort_during_decode(make_engine, async_scheduling):
    """Mid-token (a decode token looping): its slot is reused by the waiting request."""

    def ready(victim):
        return len(victim.output_token_ids) >= 3 and victim.token_in_flight

    assert _abort_when(make_engine, ready, async_scheduling) == _baseline(make_engine)


def test_abort_unknown_id_returns_none(make_engine):
    engine = make_engine()
    assert frontend(engine).abort_request("nope") is None
    frontend(engine).add_request("r", [5, 6], SamplingParams(n=2, max_tokens=2, temperature=0.0))
    assert frontend(engine).abort_request("r#0") is None  # a completion id, not a request id
    drain(engine)
    assert frontend(engine).abort_request("r") is None  # finished requests are gone


def test_abort_waiting_request(make_engine):
    """A request still queued (no slot yet) holds no blocks; aborting it leaves the rest alone."""
    engine = make_engine(max_num_seqs=1, max_num_batched_tokens=8)
    frontend(engine).add_request("first", OTHERS["a"], ADAPTIVE)
    frontend(engine).add_request("queued", VICTIM, ADAPTIVE)
    frontend(engine).step()
    assert engine.scheduler.requests["queued"].status is RequestStatus.WAITING
    free_before = engine.kv.num_free_blocks
    aborted = frontend(engine).abort_request("queued")
    assert engine.kv.num_free_blocks == free_before
    assert aborted.finished and aborted.outputs[0].finish_reason == "abort"
    assert aborted.outputs[0].token_ids == []
    assert not engine.scheduler.waiting
    first = drain(engine)["first"].outputs[0]
    alone = drain(make_engine(), {0: [("first", OTHERS["a"], ADAPTIVE)]})["first"].outputs[0]
    assert (first.token_ids, first.exit_depths) == (alone.token_ids, alone.exit_depths)


def test_abort_request_with_several_completions(make_engine):
    """Every unfinished completion of an n > 1 request is aborted and its blocks freed."""
    engine = make_engine()
    params = SamplingParams(n=3, max_tokens=6, temperature=1.0, seed=4, ignore_eos=True)
    frontend(engine).add_request("multi", [7, 8, 9], params)
    for _ in range(6):
        frontend(engine).step()
    assert engine.kv.num_free_blocks < engine.kv.num_blocks
    aborted = frontend(engine).abort_request("multi")
    assert [c.finish_reason for c in aborted.outputs] == ["abort"] * 3
    assert [c.index for c in aborted.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) >= 1 for c in aborted.outputs)
    assert engine.all_blocks_free() and not engine.has_unfinished
