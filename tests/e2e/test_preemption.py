"""Preemption is exact: with a KV pool so small that requests lose their slot again and
again, mid-prompt and mid-generation, tokens and exit depths still equal the serial oracle
in every layout, exit mode and scheduler mode, and sampled tokens, logprobs and n > 1 equal
a run that never preempts."""

from __future__ import annotations

import random

import pytest

from tests.conftest import drain, frontend
from tests.e2e.test_engine_vs_oracle import POLICIES, oracle_outputs
from vllm_rlt import ExitConfig, SamplingParams

# Short prompts decode at once; the first request then grows to 7 blocks of 4 and takes
# the blocks of the later ones, which have tokens by then: they are replayed on return.
PROMPT_LENGTHS = (2, 2, 3, 5)
MAX_TOKENS = (24, 12, 12, 10)
# Blocks: the largest request fits alone, no two of them together. (Under SHARED_DECODE a
# block holds one plane, not four: the 5-token prompt takes all 8 while it prefills.)
POOL = 8


def _prompts() -> list[list[int]]:
    rng = random.Random(3)
    return [[rng.randrange(3, 259) for _ in range(n)] for n in PROMPT_LENGTHS]


def _traces() -> dict[str, tuple[int, ...]]:
    rng = random.Random(5)
    return {
        f"r{i}": (4, *(rng.randint(1, 4) for _ in range(n - 1))) for i, n in enumerate(MAX_TOKENS)
    }


_ORACLE: dict[tuple[str, str], list] = {}


def _oracle(toy_config, toy_state, layout: str, policy: str) -> list:
    if (layout, policy) not in _ORACLE:
        _ORACLE[layout, policy] = oracle_outputs(
            toy_config,
            toy_state,
            _prompts(),
            MAX_TOKENS,
            _traces(),
            layout,
            policy,
            ignore_eos=True,
        )
    return _ORACLE[layout, policy]


def _engine(make_engine, layout, policy, mode, async_scheduling, num_blocks):
    """The engine, with a record of how many tokens each preempted request had made."""
    exit_mode, _ = POLICIES[policy]
    engine = make_engine(
        layout=layout,
        exit_config=ExitConfig(
            mode=exit_mode, depths_by_request=_traces() if exit_mode == "trace" else {}
        ),
        num_blocks=num_blocks,
        mode=mode,
        prefill_chunk_size=4,
        max_num_seqs=4,
        max_num_batched_tokens=64,
        async_scheduling=async_scheduling,
    )
    preempt = engine.scheduler._preempt
    engine.preempted_with = []

    def recording(request):
        engine.preempted_with.append(len(request.output_token_ids))
        preempt(request)

    engine.scheduler._preempt = recording
    return engine


CASES = [
    (layout, policy, mode, async_scheduling)
    for layout in ("last_exited", "shared", "shared_decode")
    for policy in POLICIES
    for mode, async_scheduling in (("refill", False), ("no_refill", False), ("refill", True))
]


@pytest.mark.parametrize(("layout", "policy", "mode", "async_scheduling"), CASES)
def test_preempted_requests_still_equal_the_oracle(
    make_engine, toy_config, toy_state, layout, policy, mode, async_scheduling
):
    engine = _engine(make_engine, layout, policy, mode, async_scheduling, POOL)
    _, threshold = POLICIES[policy]
    arrivals = {
        0: [
            (
                f"r{i}",
                prompt,
                SamplingParams(
                    max_tokens=MAX_TOKENS[i],
                    temperature=0.0,
                    exit_threshold=threshold,
                    ignore_eos=True,
                ),
            )
            for i, prompt in enumerate(_prompts())
        ]
    }
    outputs = drain(engine, arrivals)
    # Requests lost their slot with tokens made: they were replayed, not only re-prefilled.
    assert max(engine.preempted_with, default=0) >= 2, "no request was preempted mid-output"
    for i, reference in enumerate(_oracle(toy_config, toy_state, layout, policy)):
        completion = outputs[f"r{i}"].outputs[0]
        assert completion.token_ids == reference.token_ids, f"r{i} tokens"
        assert completion.exit_depths == reference.exit_depths, f"r{i} depths"


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("layout", ["last_exited", "shared", "shared_decode"])
def test_preemption_keeps_sampling_logprobs_and_n(make_engine, layout, async_scheduling):
    """Seeded sampling, top logprobs, prompt logprobs and two completions per request,
    under the ouro rule: a run preempted many times equals one with room for everything."""
    arrivals = {
        0: [
            (
                f"r{i}",
                prompt,
                SamplingParams(
                    n=2,
                    max_tokens=MAX_TOKENS[i],
                    temperature=0.9,
                    seed=i,
                    logprobs=3,
                    prompt_logprobs=2,
                    exit_threshold=0.6,
                    ignore_eos=True,
                ),
            )
            for i, prompt in enumerate(_prompts())
        ]
    }
    runs = {}
    for pool in (POOL, 256):
        engine = _engine(make_engine, layout, "ouro_q0.7", "refill", async_scheduling, pool)
        runs[pool] = drain(engine, arrivals)
        if pool == POOL:
            assert max(engine.preempted_with, default=0) >= 2
    for rid, expected in runs[256].items():
        got_prompt, want_prompt = runs[POOL][rid].prompt_logprobs, expected.prompt_logprobs
        assert got_prompt is not None and want_prompt is not None
        assert len(got_prompt) == len(want_prompt) and got_prompt[0] is None
        for a, b in zip(got_prompt[1:], want_prompt[1:], strict=True):
            assert a.keys() == b.keys()
            assert all(a[t].logprob == pytest.approx(b[t].logprob, abs=1e-5) for t in a)
        for got, want in zip(runs[POOL][rid].outputs, expected.outputs, strict=True):
            assert got.token_ids == want.token_ids and got.exit_depths == want.exit_depths
            assert len(got.logprobs) == len(want.logprobs)
            for a, b in zip(got.logprobs, want.logprobs, strict=True):
                assert a.keys() == b.keys()
                # Other rows share the passes in each run: the last bits may differ.
                assert all(a[t].logprob == pytest.approx(b[t].logprob, abs=1e-5) for t in a)


def _priority_engine(make_engine, **kwargs):
    return make_engine(
        num_blocks=64, max_num_seqs=1, scheduling_policy="priority", prefill_chunk_size=4, **kwargs
    )


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_more_urgent_request_preempts_and_both_stay_exact(make_engine, async_scheduling):
    """One slot: a request of priority 0 arriving while one of priority 5 decodes takes the
    slot at once, finishes first, and the other resumes where it was, unchanged."""
    low = SamplingParams(max_tokens=12, temperature=0.0, exit_threshold=0.6, priority=5)
    high = SamplingParams(max_tokens=6, temperature=0.0, exit_threshold=0.6, priority=0)
    prompts = _prompts()
    alone = {
        rid: drain(_priority_engine(make_engine), {0: [(rid, prompt, params)]})[rid]
        for rid, prompt, params in (("low", prompts[3], low), ("high", prompts[1], high))
    }
    engine = _priority_engine(make_engine, async_scheduling=async_scheduling)
    frontend(engine).add_request("low", prompts[3], low)
    finished_order = []
    while len(engine.scheduler.requests["low"].output_token_ids) < 3:
        finished_order += [o.request_id for o in frontend(engine).step() if o.finished]
    outputs = drain(engine, {0: [("high", prompts[1], high)]})
    finished_order += [rid for rid in outputs if rid not in finished_order]
    assert engine.scheduler.num_preemptions >= 1
    assert finished_order == ["high", "low"]
    for rid in ("low", "high"):
        got, want = outputs[rid].outputs[0], alone[rid].outputs[0]
        assert got.token_ids == want.token_ids and got.exit_depths == want.exit_depths


def test_priority_needs_the_priority_policy(make_engine):
    engine = make_engine()
    with pytest.raises(ValueError, match="priority 3 needs the priority scheduling policy") as e:
        frontend(engine).add_request("r", [5, 6], SamplingParams(priority=3))
    assert e.value.param == "priority"
    with pytest.raises(ValueError, match=r"priority must be in \[-2147483647, 2147483647\]"):
        SamplingParams(priority=2**31)


def _plain_params(**kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, exit_threshold=0.7, ignore_eos=True, **kwargs)


def test_a_resumed_request_whose_context_is_all_cached_still_gets_its_block(make_engine):
    """Preempted right after its first token, with a prompt of whole blocks still in the
    prefix cache: it must recompute the end of its prompt (and so take a block for its next
    position), not decode at once into a position without a block."""
    prompt = list(range(10, 18))  # two full blocks of 4
    params = _plain_params(max_tokens=6)
    reference = drain(make_engine(), {0: [("a", prompt, params)]})["a"].outputs[0]
    engine = make_engine()
    frontend(engine).add_request("a", prompt, params)
    request = engine.scheduler.requests["a"]
    while len(request.output_token_ids) < 1:
        frontend(engine).step()
    engine.scheduler._preempt(request)  # what the pool running dry does
    got = drain(engine)["a"].outputs[0]
    assert engine.scheduler.prefix_hits > 0
    assert (got.token_ids, got.exit_depths) == (reference.token_ids, reference.exit_depths)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_slot_taken_over_in_one_round_gets_none_of_the_old_owners_blocks(
    make_engine, async_scheduling
):
    """Priority policy: a low-priority request takes a block, is then preempted in the same
    round for a waiting request that gets its slot; the block update it left must not reach
    the newcomer's table (its last write would land in another request's block)."""

    def params(max_tokens, priority):
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=0.0,
            exit_threshold=1.0,
            priority=priority,
            ignore_eos=True,
        )

    def arrivals(use_priority):
        return {
            0: [
                ("L", [5, 6, 7, 8, 9], params(20, 5 if use_priority else 0)),
                ("M", [21, 22, 23, 24, 25, 26], params(30, 1 if use_priority else 0)),
            ],
            17: [("W", [100, 101, 102], params(6, 0))],
        }

    small = dict(max_num_seqs=2, prefill_chunk_size=4, max_num_batched_tokens=64)
    engine = make_engine(
        num_blocks=64,
        enable_prefix_caching=False,
        async_scheduling=async_scheduling,
        scheduling_policy="priority",
        **small,
    )
    got = drain(engine, arrivals(True))
    assert engine.scheduler.num_preemptions > 0
    reference = drain(
        make_engine(num_blocks=256, enable_prefix_caching=False, **small), arrivals(False)
    )
    for rid in "LMW":
        assert got[rid].outputs[0].token_ids == reference[rid].outputs[0].token_ids, rid
