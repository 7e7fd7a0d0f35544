"""Self-speculative decoding is exact: greedy fixed-depth outputs with drafts of d loops
verified by the remaining ones equal plain decoding, for every K and d, with other requests
in the same passes, chunked prompts, asynchronous scheduling, stops right after an
accepted draft, n > 1 and preemption; and it pipelines: an accepted draft saves D - d
passes."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from tests.conftest import drain, frontend
from vllm_rlt import SamplingParams, SpeculativeConfig
from vllm_rlt.config import AUTO_DISABLE_BY_BATCH_SIZE

PROMPT_LENGTHS = (1, 5, 13, 23)
MAX_TOKENS = (9, 17, 11, 14)
ARRIVALS = (0, 0, 3, 8)


def _prompts() -> list[list[int]]:
    rng = random.Random(17)
    return [[rng.randrange(3, 259) for _ in range(n)] for n in PROMPT_LENGTHS]


def _greedy(i: int, **kwargs) -> SamplingParams:
    return SamplingParams(
        max_tokens=MAX_TOKENS[i], **{"temperature": 0.0, "exit_threshold": 1.0, **kwargs}
    )


def _run(make_engine, spec=None, params_of=_greedy, **kwargs):
    kwargs.setdefault("max_num_seqs", 8)  # up to four lanes each: 32 decode rows
    engine = make_engine(
        prefill_chunk_size=4, max_num_batched_tokens=64, speculative_config=spec, **kwargs
    )
    arrivals: dict[int, list] = {}
    for i, prompt in enumerate(_prompts()):
        arrivals.setdefault(ARRIVALS[i], []).append((f"r{i}", prompt, params_of(i)))
    return engine, drain(engine, arrivals)


def _tokens(outputs) -> dict:
    return {
        (rid, c.index): (c.token_ids, c.exit_depths, c.finish_reason, c.text)
        for rid, o in outputs.items()
        for c in o.outputs
    }


@pytest.mark.parametrize(("tokens", "draft_loops"), [(1, 1), (2, 3), (4, 2), (3, 3)])
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_speculation_equals_plain_greedy(make_engine, tokens, draft_loops, async_scheduling):
    _, plain = _run(make_engine)
    spec = SpeculativeConfig(num_speculative_tokens=tokens, draft_loops=draft_loops)
    engine, speculative = _run(make_engine, spec, async_scheduling=async_scheduling)
    assert _tokens(speculative) == _tokens(plain)
    assert engine.scheduler.num_drafted > 0
    if draft_loops == 3:  # three of four loops: the drafts mostly agree
        assert engine.scheduler.num_accepted > 0


def test_the_built_in_model_accepts_its_two_loop_drafts():
    """The built-in model answers at depth 2 almost as at depth 4, so drafts of two loops
    are accepted (nearly) always: same answers, fewer passes."""
    from vllm_rlt import LLM
    from vllm_rlt.training.data import held_out, training_set

    prompts = [prompt for prompt, _ in held_out("add", 20, training_set("add", 40000))]
    params = SamplingParams(max_tokens=12, temperature=0.0, exit_threshold=1.0)
    plain = LLM()
    want = [o.outputs[0].text for o in plain.generate(prompts, params, use_tqdm=False)]
    spec = LLM(speculative_config=SpeculativeConfig(num_speculative_tokens=3, draft_loops=2))
    got = [o.outputs[0].text for o in spec.generate(prompts, params, use_tqdm=False)]
    assert got == want
    scheduler = spec.engine.scheduler
    assert scheduler.num_accepted >= 0.9 * scheduler.num_drafted > 0
    assert spec.engine.passes.num_passes < plain.engine.passes.num_passes


def test_stops_n_and_unspeculated_requests(make_engine):
    """A stop token inside an accepted run cuts there; two completions each speculate; a
    sampled request with a presence penalty (not speculated) is unchanged beside them."""
    _, plain = _run(make_engine)
    stop = plain["r1"].outputs[0].token_ids[6]

    def params_of(i: int) -> SamplingParams:
        if i == 2:  # a logit adjustment: decodes loop by loop as usual
            return SamplingParams(
                max_tokens=11, temperature=0.8, seed=5, exit_threshold=0.7, presence_penalty=0.5
            )
        if i == 3:
            return _greedy(i, n=2)
        return _greedy(i, stop_token_ids=[stop])

    _, want = _run(make_engine, params_of=params_of)
    spec = SpeculativeConfig(num_speculative_tokens=4, draft_loops=3)
    _, got = _run(make_engine, spec, params_of=params_of)
    assert _tokens(got) == _tokens(want)
    assert got["r1"].outputs[0].finish_reason == "stop"


def test_preempted_speculating_requests_stay_exact(make_engine):
    _, plain = _run(make_engine)
    spec = SpeculativeConfig(num_speculative_tokens=3, draft_loops=2)
    engine, got = _run(make_engine, spec, num_blocks=11, max_num_seqs=4)
    assert engine.scheduler.num_preemptions > 0
    assert _tokens(got) == _tokens(plain)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"draft_loops": 4}, r"draft_loops must be in \[1, 3\]"),
        ({"layout": "shared"}, "needs the last_exited KV layout"),
        ({"mode": "no_refill"}, "needs the refill scheduling mode"),
    ],
)
def test_unsupported_combinations_are_refused(make_engine, kwargs, message):
    spec = SpeculativeConfig(draft_loops=kwargs.pop("draft_loops", 2))
    with pytest.raises(ValueError, match=message):
        make_engine(speculative_config=spec, **kwargs)


def test_config_ranges():
    with pytest.raises(ValueError, match=r"num_speculative_tokens must be in \[1, 16\]"):
        SpeculativeConfig(num_speculative_tokens=0)
    with pytest.raises(ValueError, match=r"must be 'auto' or an integer in \[1, 16\]"):
        SpeculativeConfig(num_speculative_tokens="many")
    with pytest.raises(ValueError, match=r"draft_loops must be >= 1"):
        SpeculativeConfig(draft_loops=0)
    with pytest.raises(ValueError, match=r"disable_by_batch_size must be >= 1"):
        SpeculativeConfig(disable_by_batch_size=0)
    auto = SpeculativeConfig(num_speculative_tokens="auto")
    assert auto.batch_limit == AUTO_DISABLE_BY_BATCH_SIZE and auto.max_ahead == 16
    assert SpeculativeConfig("auto", disable_by_batch_size=3).batch_limit == 3
    assert SpeculativeConfig(2).batch_limit is None


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_drafting_stops_under_load_and_resumes(make_engine, async_scheduling):
    """With disable_by_batch_size 1, lanes draft only while a single request runs; the
    others decode in their own slot, one row each, and every output stays exact."""
    _, plain = _run(make_engine)
    spec = SpeculativeConfig(3, 2, disable_by_batch_size=1)
    engine, got = _run(make_engine, spec, async_scheduling=async_scheduling)
    assert _tokens(got) == _tokens(plain)
    assert engine.scheduler.num_drafted > 0  # the last request runs alone for a while


def test_under_load_speculation_costs_no_rows(make_engine):
    """Two requests that always run together, limit 1: not one draft, and exactly the
    passes and rows of plain decoding."""
    params = SamplingParams(max_tokens=9, exit_threshold=1.0, ignore_eos=True)
    arrivals = {0: [("a", [5, 6], params), ("b", [7, 8, 9], params)]}
    runs = []
    for spec in (None, SpeculativeConfig("auto", 2, disable_by_batch_size=1)):
        engine = make_engine(speculative_config=spec)
        outputs = drain(engine, arrivals)
        runs.append(([o.outputs[0].token_ids for o in outputs.values()], engine.passes.num_passes))
        rows = engine.passes.num_rows_total
    assert runs[0] == runs[1]
    assert engine.scheduler.num_drafted == 0
    plain_engine = make_engine()
    drain(plain_engine, arrivals)
    assert rows == plain_engine.passes.num_rows_total


def test_stats_count_drafts_and_acceptance():
    from vllm_rlt import LLM

    llm = LLM(speculative_config=SpeculativeConfig(num_speculative_tokens=3, draft_loops=1))
    params = SamplingParams(max_tokens=12, temperature=0.0, exit_threshold=1.0)
    llm.generate(["347+589=", "912-358="], params, use_tqdm=False)
    stats = llm.stats()
    assert stats["spec_num_drafts"] > 0
    assert 0 < stats["spec_num_accepted_tokens"] <= stats["spec_num_draft_tokens"]
    assert stats["spec_acceptance_rate"] == (
        stats["spec_num_accepted_tokens"] / stats["spec_num_draft_tokens"]
    )
    # One-loop drafts on four loops: up to three run ahead of the verified token, and one
    # made two ahead is verified only once the one before it was accepted.
    per_position = stats["spec_accepted_per_position"]
    assert len(per_position) == 3 and sum(per_position) == stats["spec_num_accepted_tokens"]
    assert per_position[0] >= per_position[1] >= per_position[2]


@pytest.mark.parametrize(("rate", "draft_loops"), [(1.0, 2), (1.0, 1), (1.0, 3), (0.0, 2)])
def test_each_accepted_draft_saves_the_verify_loops(make_engine, rate, draft_loops):
    """With every draft accepted a token takes d passes after the first decode token's D;
    with none, D as without speculation (the refused position restarts at once)."""
    loops, max_tokens = 4, 9
    spec = SpeculativeConfig(3, draft_loops, replay_acceptance_rate=rate)
    engine = make_engine(speculative_config=spec, async_scheduling=False)
    params = SamplingParams(max_tokens=max_tokens, exit_threshold=1.0, ignore_eos=True)
    outputs = drain(engine, {0: [("r", [7], params)]})
    assert len(outputs["r"].outputs[0].token_ids) == max_tokens
    per_token = draft_loops if rate == 1.0 else loops
    assert engine.passes.num_passes == 2 * loops + (max_tokens - 2) * per_token
    # every decode position drafts its successor but the last, which has none to compute
    assert engine.scheduler.num_drafted == max_tokens - 2
    assert engine.scheduler.num_accepted == rate * (max_tokens - 2)


def test_sampled_speculation_follows_the_target_distribution(make_engine):
    """Rejection sampling keeps the target's distribution: over 1,500 seeded requests the
    speculated second and third tokens are distributed as plain sampling's (total
    variation at the level two samples of this size differ by), while decoding at the
    draft depth alone is far off. The first token comes from the prefill: identical."""

    def draws(spec=None, max_loops=None) -> list[tuple[int, ...]]:
        # a prefill in flight per slot: some 80 passes, where the CPU default of 4 takes 1,500
        engine = make_engine(
            num_blocks=2048,
            max_num_seqs=256,
            max_num_batched_tokens=4096,
            max_prefill_batches_before_decode=256,
            speculative_config=spec,
        )
        params = [
            SamplingParams(
                max_tokens=3,
                temperature=1.0,
                top_k=6,
                seed=seed,
                exit_threshold=1.0,
                max_loops=max_loops,
                ignore_eos=True,
            )
            for seed in range(1500)
        ]
        outputs = drain(
            engine, {0: [(f"s{i}", [40, 71, 12, 200, 9], p) for i, p in enumerate(params)]}
        )
        if spec is not None:
            assert 0 < engine.scheduler.num_accepted < engine.scheduler.num_drafted
        return [tuple(o.outputs[0].token_ids) for o in outputs.values()]

    def distance(a: list[tuple[int, ...]], b: list[tuple[int, ...]], index: int) -> float:
        count_a = Counter(x[index] for x in a)
        count_b = Counter(x[index] for x in b)
        tokens = set(count_a) | set(count_b)
        return 0.5 * sum(abs(count_a[t] / len(a) - count_b[t] / len(b)) for t in tokens)

    plain = draws()
    speculative = draws(SpeculativeConfig(num_speculative_tokens=2, draft_loops=2))
    shallow = draws(max_loops=2)
    assert distance(speculative, plain, 0) == 0.0
    for index, bound in ((1, 0.1), (2, 0.15)):
        assert distance(speculative, plain, index) < bound
        assert distance(shallow, plain, index) > 2 * bound


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_sampled_speculation_is_reproducible_under_preemption(make_engine, async_scheduling):
    """Seeded draws depend on the request and the token's index only: a run that preempts
    gives the same sampled tokens as one with room for everything."""
    spec = SpeculativeConfig(num_speculative_tokens=3, draft_loops=2)

    def params_of(i: int) -> SamplingParams:
        return _greedy(i, temperature=0.9, top_p=0.9, seed=40 + i)

    runs = []
    for blocks in (11, 128):
        engine, outputs = _run(
            make_engine,
            spec,
            params_of=params_of,
            num_blocks=blocks,
            max_num_seqs=4,
            async_scheduling=async_scheduling,
        )
        runs.append(_tokens(outputs))
        assert (engine.scheduler.num_preemptions > 0) == (blocks == 11)
    assert runs[0] == runs[1]


def test_blocks_taken_in_a_pass_with_no_rows_reach_the_tables(make_engine):
    """A schedule can have no rows but still take blocks, such as the cached prefix of a
    request it admits (with asynchronous scheduling, when every running request waits on
    the pass in flight): they must reach the device tables before any later pass."""
    from vllm_rlt.core.contract import SchedulerOutput

    engine = make_engine(async_scheduling=True)
    drain(engine, {0: [("warm", [5, 6, 7], SamplingParams(max_tokens=2))]})
    frontend(engine).add_request("r", [5, 6, 7], SamplingParams(max_tokens=1))
    schedule = engine.scheduler.schedule
    calls = []

    def empty_with_a_block() -> SchedulerOutput:
        if calls:
            return schedule()
        calls.append(schedule())  # launch the real first pass, keep it in flight
        return calls[0]

    engine.scheduler.schedule = empty_with_a_block
    frontend(engine).step()  # the real pass is now in flight
    row = engine.scheduler.running[next(iter(engine.scheduler.running))].slot
    empty = SchedulerOutput((), (), (), (), 0, ((row, 7, 3),))
    engine.scheduler.schedule = lambda: empty
    frontend(engine).step()
    assert int(engine.runner.state.block_table[row, 7]) == 3
    engine.runner.state.block_table[row, 7] = engine.runner.state.dummy_block
    engine.scheduler.schedule = schedule
    drain(engine)


ADAPTIVE_CASES = [
    (policy, draft_loops, async_scheduling)
    for policy in ("ouro_q0.3", "ouro_q0.7", "ouro_delayed_q0.5", "trace")
    for draft_loops, async_scheduling in ((1, False), (2, False), (2, True))
]


@pytest.mark.parametrize(("policy", "draft_loops", "async_scheduling"), ADAPTIVE_CASES)
def test_adaptive_depth_speculation_is_exact(make_engine, policy, draft_loops, async_scheduling):
    """Under every exit rule, speculating requests give plain decoding's tokens and exit
    depths: a token's exit decision reads the same state as without speculation, and one
    that comes while the token is still a draft waits for its verification."""
    from tests.e2e.test_engine_vs_oracle import POLICIES
    from vllm_rlt import ExitConfig

    mode, threshold = POLICIES[policy]
    rng = random.Random(11)
    traces = {
        f"r{i}": (4, *(rng.randint(1, 4) for _ in range(n - 1))) for i, n in enumerate(MAX_TOKENS)
    }
    exit_config = ExitConfig(mode=mode, depths_by_request=traces if mode == "trace" else {})

    def params_of(i: int) -> SamplingParams:
        return _greedy(i, exit_threshold=threshold)

    def depths(outputs) -> dict:
        return {rid: o.outputs[0].exit_depths for rid, o in outputs.items()}

    _, plain = _run(make_engine, params_of=params_of, exit_config=exit_config)
    spec = SpeculativeConfig(3, draft_loops)
    engine, got = _run(
        make_engine,
        spec,
        params_of=params_of,
        exit_config=exit_config,
        async_scheduling=async_scheduling,
    )
    assert _tokens(got) == _tokens(plain)
    assert depths(got) == depths(plain)
    assert len({d for ds in depths(plain).values() for d in ds}) > 1  # depths do vary
    assert engine.scheduler.num_drafted > 0


def test_lanes_coming_back_stay_within_the_row_budget(make_engine):
    """A collapsed request (one row) gets its lanes back when drafting resumes; that pass
    counts all of them before prefill chunks take the rest of the budget."""
    budget = 20
    engine = make_engine(
        speculative_config=SpeculativeConfig(3, 1, disable_by_batch_size=2),
        max_num_seqs=5,
        max_num_batched_tokens=budget,
        prefill_chunk_size=16,
    )
    scheduler = engine.scheduler
    long = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    short = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    frontend(engine).add_request("a", [5, 6, 7], long)
    frontend(engine).add_request("b", [8, 9], short)
    frontend(engine).add_request("c", [10, 11], short)
    while len(scheduler.running) + len(scheduler.waiting) > 1:
        frontend(engine).step()  # three run: drafting is off and "a" decodes in its own slot
    (lone,) = scheduler.running.values()
    assert lone.lanes_collapsed
    for name in ("d", "e"):
        frontend(engine).add_request(name, [12] * 30, short)
    output = scheduler.schedule()  # one runs: "a" gets its lanes back, then the prompts
    assert not lone.lanes_collapsed and output.drafting
    assert output.num_rows == budget
    for request_id in list(engine.groups):
        frontend(engine).abort_request(request_id)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_logprobs_and_min_tokens_speculate_exactly(make_engine, async_scheduling):
    """Lanes give top logprobs from the committing lane's full-depth logits (a held lane's
    from the state it exited with) and apply the min_tokens ban to drafts and commits
    alike: tokens, exit depths and logprobs equal plain decoding's."""

    def params_of(i: int) -> SamplingParams:
        return _greedy(
            i, logprobs=3, min_tokens=MAX_TOKENS[i] - 2, exit_threshold=(1.0, 0.7)[i % 2]
        )

    _, plain = _run(make_engine, params_of=params_of)
    engine, got = _run(
        make_engine, SpeculativeConfig(3, 2), params_of=params_of, async_scheduling=async_scheduling
    )
    assert engine.scheduler.num_drafted > 0
    assert _tokens(got) == _tokens(plain)
    for rid, want in plain.items():
        ours, theirs = got[rid].outputs[0], want.outputs[0]
        assert ours.exit_depths == theirs.exit_depths
        for mine, ref in zip(ours.logprobs, theirs.logprobs, strict=True):
            assert mine.keys() == ref.keys()
            assert all(abs(mine[k].logprob - ref[k].logprob) < 1e-4 for k in ref)
