"""Sampling on the toy: seeded batch invariance, filters that collapse to greedy, logprobs,
and the counter-based sampler itself (docs/design.md §3.5)."""

from __future__ import annotations

import math
import random
from dataclasses import replace

import pytest
import torch

from tests.conftest import drain, frontend
from vllm_rlt import SamplingParams
from vllm_rlt.layers.sampler import (
    SamplingMode,
    SamplingTensors,
    _filtered_sorted,
    gumbel_noise,
    row_sampling_mode,
    sample,
    sample_plain,
    seeded_uniform,
    token_logprobs,
)

PROMPT = [40, 71, 12, 200, 9]
SEEDED = SamplingParams(
    max_tokens=10, temperature=0.8, top_k=40, top_p=0.9, seed=1234, exit_threshold=0.5
)


def _one(make_engine, params: SamplingParams, prompt=PROMPT, **engine_kwargs):
    """The single RequestOutput of `prompt` run alone on a fresh engine."""
    return drain(make_engine(**engine_kwargs), {0: [("only", prompt, params)]})["only"]


def _greedy_tokens(make_engine, max_tokens: int = 8) -> list[int]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return _one(make_engine, params).outputs[0].token_ids


# --------------------------------------------------------------------------- engine level
@pytest.mark.parametrize("mode", ["refill", "no_refill"])
def test_seeded_request_is_batch_invariant(make_engine, mode):
    """A seeded request samples the same tokens (and depths) alone and in a busy batch."""
    alone = _one(make_engine, SEEDED, mode=mode).outputs[0]
    rng = random.Random(5)
    arrivals: dict[int, list] = {0: []}
    for i, (length, step) in enumerate([(3, 0), (11, 0), (1, 2), (17, 5), (6, 9)]):
        prompt = [rng.randrange(3, 259) for _ in range(length)]
        other = SamplingParams(max_tokens=6 + i, temperature=1.0, exit_threshold=0.3)
        arrivals.setdefault(step, []).append((f"other{i}", prompt, other))
    arrivals[3] = [*arrivals.get(3, []), ("seeded", PROMPT, SEEDED)]
    engine = make_engine(mode=mode, prefill_chunk_size=4, max_num_seqs=4, max_num_batched_tokens=12)
    together = drain(engine, arrivals)["seeded"].outputs[0]
    assert len(alone.token_ids) > 3
    assert together.token_ids == alone.token_ids
    assert together.exit_depths == alone.exit_depths


def test_seeds_change_the_output_and_repeat_it(make_engine):
    """The seed, not the engine's history, decides a seeded request's tokens."""
    first = _one(make_engine, SEEDED).outputs[0].token_ids
    again = _one(make_engine, SEEDED).outputs[0].token_ids
    other = _one(make_engine, replace(SEEDED, seed=99)).outputs[0].token_ids
    assert first == again
    assert other != first
    # vLLM's whole int64 range: a negative seed is its value mod 2**63
    negative = _one(make_engine, replace(SEEDED, seed=-1)).outputs[0].token_ids
    assert negative == _one(make_engine, replace(SEEDED, seed=2**63 - 1)).outputs[0].token_ids
    assert negative != first


def test_n_completions_are_distinct_and_reproducible(make_engine):
    params = SamplingParams(n=3, max_tokens=6, temperature=1.0, seed=7, ignore_eos=True)
    first = _one(make_engine, params)
    second = _one(make_engine, params)
    assert [c.index for c in first.outputs] == [0, 1, 2]
    tokens = [tuple(c.token_ids) for c in first.outputs]
    assert len(set(tokens)) == 3
    assert tokens == [tuple(c.token_ids) for c in second.outputs]


@pytest.mark.parametrize(
    "filters",
    [{"top_k": 1}, {"min_p": 1.0}, {"top_p": 1e-6}, {"top_n_sigma": 1e-6}],
    ids=["top_k", "min_p", "top_p", "top_n_sigma"],
)
def test_degenerate_filters_equal_greedy(make_engine, filters):
    """A filter that keeps only the most likely token makes sampling greedy at any seed."""
    greedy = _greedy_tokens(make_engine)
    for seed in (0, 1):
        params = SamplingParams(
            max_tokens=8, temperature=1.0, seed=seed, ignore_eos=True, **filters
        )
        assert _one(make_engine, params).outputs[0].token_ids == greedy
    # Without the filter the same seeds do not reproduce greedy, so the filter did the work.
    plain = SamplingParams(max_tokens=8, temperature=1.0, seed=0, ignore_eos=True)
    assert _one(make_engine, plain).outputs[0].token_ids != greedy


def test_a_pass_sorts_the_vocabulary_only_when_a_row_filters(make_engine, monkeypatch):
    """Rows that filter nothing take `sample_plain` (no sort); a pass with a filtering row
    takes the filtered path for all its rows, and a seeded unfiltered request draws the
    same tokens either way."""
    from vllm_rlt.ops.torch_ops import TorchOps

    calls = {"plain": 0, "sorted": 0}

    def counted(name, function):
        def call(*args, **kwargs):
            calls[name] += 1
            return function(*args, **kwargs)

        return call

    monkeypatch.setattr(TorchOps, "sample_plain", counted("plain", TorchOps.sample_plain))
    monkeypatch.setattr(TorchOps, "sample_filtered", counted("sorted", TorchOps.sample_filtered))
    unfiltered = SamplingParams(max_tokens=8, temperature=0.9, seed=11, ignore_eos=True)
    alone = _one(make_engine, unfiltered).outputs[0].token_ids
    assert calls["plain"] > 0 and calls["sorted"] == 0
    filtering = SamplingParams(max_tokens=8, temperature=1.0, top_p=0.8, seed=3, ignore_eos=True)
    arrivals = {0: [("unfiltered", PROMPT, unfiltered), ("filtering", [7, 8, 9], filtering)]}
    outputs = drain(make_engine(), arrivals)
    assert calls["sorted"] > 0
    assert outputs["unfiltered"].outputs[0].token_ids == alone


@pytest.mark.parametrize(
    ("fields", "mode"),
    [
        ({"temperature": 0.0, "top_p": 0.5}, SamplingMode.GREEDY),
        ({"temperature": 1.0}, SamplingMode.PLAIN),
        ({"temperature": 1.0, "top_k": -1}, SamplingMode.PLAIN),
        ({"temperature": 1.0, "top_k": 5}, SamplingMode.FILTERED),
        ({"temperature": 1.0, "top_p": 0.99}, SamplingMode.FILTERED),
        ({"temperature": 1.0, "min_p": 0.1}, SamplingMode.FILTERED),
        ({"temperature": 1.0, "top_n_sigma": 2.0}, SamplingMode.FILTERED),
        ({"temperature": 1.0, "top_n_sigma": -1.0}, SamplingMode.PLAIN),
    ],
)
def test_each_request_says_which_sampling_path_it_needs(fields, mode):
    # the record the device reads takes these fields from SamplingParams by name
    assert row_sampling_mode(SamplingParams(max_tokens=4, **fields)) == mode


def test_logprobs_entries(make_engine):
    """Each entry holds the sampled token first, then the top N (sorted, non-positive,
    ranked 1 to N), as vLLM's."""
    num = 4
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=3, logprobs=num, ignore_eos=True)
    completion = _one(make_engine, params).outputs[0]
    assert len(completion.logprobs) == len(completion.token_ids) == 8
    not_top = 0
    for token, entry in zip(completion.token_ids, completion.logprobs, strict=True):
        assert next(iter(entry)) == token
        assert len(entry) in (num, num + 1)
        values = [v.logprob for v in entry.values()]
        assert all(value <= 0.0 for value in values)
        assert sum(math.exp(v) for v in values) <= 1.0 + 1e-5
        top = sorted(entry.values(), key=lambda v: v.rank)[:num]
        assert [v.rank for v in top] == list(range(1, num + 1))
        assert [v.logprob for v in top] == sorted((v.logprob for v in top), reverse=True)
        if len(entry) == num + 1:  # sampled outside the top N: it is the least likely
            not_top += 1
            assert entry[token].rank > num and entry[token].logprob <= top[-1].logprob
    assert not_top > 0  # temperature 1 picked something outside the top 4 at least once
    assert completion.cumulative_logprob == pytest.approx(
        sum(
            entry[t].logprob
            for t, entry in zip(completion.token_ids, completion.logprobs, strict=True)
        )
    )


def test_token_logprobs_rank_among_all_tokens():
    """vLLM's rank: 1 + how many other tokens are at least as likely (ties share the worse
    rank), for the sampled token wherever it stands."""
    logits = torch.tensor([[0.0, 2.0, 1.0, 2.0, -1.0], [3.0, 0.0, 0.0, 0.0, 0.0]])
    chosen, ranks, top_ids, top_values = token_logprobs(logits, torch.tensor([2, 4]), 2)
    assert ranks.tolist() == [3, 5]
    assert chosen.tolist() == pytest.approx(logits.log_softmax(-1)[[0, 1], [2, 4]].tolist())
    assert top_ids[1].tolist()[0] == 0 and top_values.shape == (2, 2)


def test_sampled_ranks_count_the_more_likely_tokens(make_engine):
    """The sampled token's rank is its place among all tokens: inside the top N it equals
    its place there, outside it exceeds N; prompt tokens' ranks likewise."""
    num = 3
    params = SamplingParams(
        max_tokens=12, temperature=1.5, seed=5, logprobs=num, prompt_logprobs=num, ignore_eos=True
    )
    output = _one(make_engine, params)
    completion = output.outputs[0]
    entries = list(zip(completion.token_ids, completion.logprobs, strict=True))
    entries += list(zip(output.prompt_token_ids[1:], output.prompt_logprobs[1:], strict=True))
    outside = 0
    for token, entry in entries:
        top = [t for t, v in sorted(entry.items(), key=lambda item: item[1].rank)][:num]
        if token in top:
            assert entry[token].rank == top.index(token) + 1
        else:
            outside += 1
            assert entry[token].rank > num
            assert entry[token].logprob <= min(entry[t].logprob for t in top)
    assert outside > 0


def test_greedy_logprobs_put_the_sampled_token_first(make_engine):
    params = SamplingParams(max_tokens=5, temperature=0.0, logprobs=3, ignore_eos=True)
    completion = _one(make_engine, params).outputs[0]
    for token, entry in zip(completion.token_ids, completion.logprobs, strict=True):
        assert len(entry) == 3 and next(iter(entry)) == token
        assert entry[token].rank == 1
        assert entry[token].logprob == max(v.logprob for v in entry.values())


def test_zero_logprobs_gives_only_the_sampled_token(make_engine):
    params = SamplingParams(max_tokens=4, temperature=0.7, seed=2, logprobs=0, ignore_eos=True)
    completion = _one(make_engine, params).outputs[0]
    assert [list(entry) for entry in completion.logprobs] == [[t] for t in completion.token_ids]
    assert all(
        entry[t].logprob <= 0.0
        for t, entry in zip(completion.token_ids, completion.logprobs, strict=True)
    )


def test_logprobs_counts_differ_within_one_batch(make_engine):
    """Rows asking for different numbers of alternatives share passes, each gets its own."""
    wanted = {"none": None, "one": 1, "five": 5}
    arrivals = {
        0: [
            (name, PROMPT, SamplingParams(max_tokens=4, temperature=0.0, logprobs=num))
            for name, num in wanted.items()
        ]
    }
    outputs = drain(make_engine(), arrivals)
    assert outputs["none"].outputs[0].logprobs is None
    for name in ("one", "five"):
        completion = outputs[name].outputs[0]
        assert [len(entry) for entry in completion.logprobs] == [wanted[name]] * len(
            completion.token_ids
        )  # greedy: the sampled token is the top one, so no extra entry
    first, second = outputs["one"].outputs[0].logprobs, outputs["five"].outputs[0].logprobs
    for a, b in zip(first, second, strict=True):
        # The same prompt in two rows: the same top token; its logprob may differ in the
        # last bits, since a CPU matmul need not treat every row of a batch alike.
        assert a.keys() <= b.keys()
        assert all(v.logprob == pytest.approx(b[t].logprob, abs=1e-5) for t, v in a.items())


# --------------------------------------------------------------------------- sampler unit
def test_seeded_uniform_is_open_unit_interval():
    seeds = torch.tensor([0, 1, 2**32, 2**63 - 1, 123456789], dtype=torch.int64)
    counters = torch.tensor([0, 5, 2**31, 7, 2**40], dtype=torch.int64)
    noise = seeded_uniform(seeds, counters, 4096)
    assert noise.dtype == torch.float64
    assert float(noise.min()) > 0.0 and float(noise.max()) < 1.0
    assert abs(float(noise.mean()) - 0.5) < 0.01
    assert abs(float((noise < 0.25).double().mean()) - 0.25) < 0.01


def test_seeded_uniform_depends_only_on_seed_counter_and_token():
    seeds = torch.tensor([11, 22, 33, 11], dtype=torch.int64)
    counters = torch.tensor([0, 0, 9, 1], dtype=torch.int64)
    batch = seeded_uniform(seeds, counters, 300)
    for row in range(4):
        alone = seeded_uniform(seeds[row : row + 1], counters[row : row + 1], 300)
        assert torch.equal(batch[row], alone[0])
    # A smaller vocabulary is a prefix: token id, not batch shape, picks the value.
    assert torch.equal(seeded_uniform(seeds, counters, 17), batch[:, :17])
    # Seed (both halves) and counter each change the noise.
    assert not torch.equal(batch[0], batch[3])
    high = seeded_uniform(torch.tensor([11 + 2**32]), torch.tensor([0]), 300)
    assert not torch.equal(high[0], batch[0])


def _sample(logits, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seeds=None, counters=None):
    rows = logits.shape[0]
    settings = SamplingTensors.filled(
        rows,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        min_p=min_p,
        seed=0 if seeds is None else seeds,
    )
    return sample(
        logits, settings, torch.arange(rows, dtype=torch.int64) if counters is None else counters
    )


def test_sample_row_is_independent_of_its_batch():
    """The same (logits, params, seed, counter) row samples the same id in any batch."""
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 50, generator=generator) * 2
    temperature = torch.tensor([0.0, 0.5, 1.0, 1.5, 0.8, 1.0])
    top_k = torch.tensor([0, 5, 0, 10, 0, 3])
    top_p = torch.tensor([1.0, 1.0, 0.9, 0.8, 1.0, 1.0])
    min_p = torch.tensor([0.0, 0.0, 0.0, 0.05, 0.1, 0.0])
    seeds = torch.tensor([1, 2, 3, 4, 5, 6])
    counters = torch.tensor([0, 3, 1, 4, 1, 5])
    settings = SamplingTensors.filled(
        6, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=seeds
    )
    together = sample(logits, settings, counters)
    order = torch.tensor([4, 0, 5, 2, 1, 3])
    shuffled = sample(logits[order], settings.rows(order), counters[order])
    assert torch.equal(shuffled, together[order])
    for row in range(6):
        one = slice(row, row + 1)
        alone = sample(logits[one], settings.rows(one), counters[one])
        assert int(alone[0]) == int(together[row])
    assert int(together[0]) == int(logits[0].argmax())


def drawn_in_sorted_order(logits, settings, counters) -> torch.Tensor:
    """The draw as a sort-based sampler takes it: the noise gathered into the sorted order
    and the argmax of the filtered sorted logits plus it (greedy rows: the argmax)."""
    sorted_logits, sorted_ids = _filtered_sorted(logits, settings)
    noise = gumbel_noise(settings.seed, counters, logits.shape[-1]).gather(1, sorted_ids)
    choice = (sorted_logits.double() + noise).argmax(dim=-1, keepdim=True)
    drawn = sorted_ids.gather(1, choice).squeeze(1)
    return torch.where(settings.temperature == 0.0, logits.argmax(dim=-1), drawn)


def hard_sampling_case(rows: int, vocab: int, gen: torch.Generator, device: str = "cpu"):
    """(logits, settings, counters) with barred tokens, tied logits, greedy rows, a tiny
    temperature, extreme seeds and counters, and every filter on some rows."""
    logits = 4 * torch.randn(rows, vocab, generator=gen, device=device)
    logits[0, : vocab // 2] = float("-inf")
    logits[-1, [3, vocab - 1]] = logits[-1].max() + 1
    greedy = rows // 2  # tied at the top too: it takes the first
    logits[greedy, [5, vocab - 2]] = logits[greedy].max() + 1
    temperature = 2 * torch.rand(rows, generator=gen, device=device)
    if rows > 1:
        temperature[-1] = 1e-9
    temperature[greedy] = 0.0
    seeds = torch.randint(0, 2**62, (rows,), generator=gen, device=device)
    seeds[0] = 2**63 - 1
    counters = torch.randint(0, 2**40, (rows,), generator=gen, device=device)
    pick = torch.arange(rows, device=device) % 5
    settings = SamplingTensors.filled(
        rows,
        device,
        temperature=temperature,
        top_k=torch.where(pick == 1, 7, 0),
        top_p=torch.where(pick == 2, 0.8, 1.0),
        min_p=torch.where(pick == 3, 0.05, 0.0),
        top_n_sigma=torch.where(pick == 4, 1.5, 0.0),
        seed=seeds,
    )
    return logits, settings, counters


@pytest.mark.parametrize(("rows", "vocab"), [(1, 300), (7, 1000), (40, 5000)])
def test_sampling_draws_the_sort_orders_token(rows, vocab):
    """The filters put back in token order and the noise hashed in token order draw the
    token a sort-based sampler draws, filtered or not: at any seed and counter, with
    barred tokens, tied logits, a tiny temperature and greedy rows. With no filter,
    `sample_plain` draws it with no sort at all."""
    gen = torch.Generator().manual_seed(rows * vocab)
    for _ in range(5):
        logits, settings, counters = hard_sampling_case(rows, vocab, gen)
        want = drawn_in_sorted_order(logits, settings, counters)
        assert torch.equal(sample(logits, settings, counters), want)
        plain = SamplingTensors.filled(rows, temperature=settings.temperature, seed=settings.seed)
        want = drawn_in_sorted_order(logits, plain, counters)
        assert torch.equal(sample_plain(logits, plain.temperature, plain.seed, counters), want)


def test_filters_cut_equal_logits_by_token_id():
    """Where top-k or top-p cuts inside a run of equal logits, the lower token ids are
    kept (the order a backend that searches for the cut instead of sorting reproduces)."""
    logits = torch.tensor([[1.0, 2.0, 2.0, 2.0, 2.0, 0.0]]).expand(64, 6)
    counters = torch.arange(64)
    for fields, allowed in (({"top_k": 3}, {1, 2, 3}), ({"top_p": 0.3}, {1, 2})):
        settings = SamplingTensors.filled(64, temperature=1.0, seed=5, **fields)
        assert set(sample(logits, settings, counters).tolist()) == allowed


def test_sample_frequencies_follow_softmax():
    """Over a few thousand counters, temperature sampling reproduces the softmax, and top-k /
    top-p renormalise over the tokens they keep."""
    base = torch.tensor([2.0, 1.0, 0.0, -1.0, -2.0])
    draws = 4000
    logits = base.expand(draws, -1).contiguous()
    seeds = torch.full((draws,), 42, dtype=torch.int64)

    def frequencies(**kwargs) -> torch.Tensor:
        ids = _sample(logits, seeds=seeds, **kwargs)
        return torch.bincount(ids, minlength=5).double() / draws

    cases = [
        ({}, base.softmax(0)),
        ({"temperature": 0.5}, (base / 0.5).softmax(0)),
        ({"top_k": 2}, base[:2].softmax(0)),
        ({"top_p": 0.9}, base[:3].softmax(0)),  # 0.636 + 0.234 < 0.9 <= 0.956
    ]
    for kwargs, expected in cases:
        expected = torch.cat([expected.double(), torch.zeros(5 - expected.numel())])
        got = frequencies(**kwargs)
        assert torch.allclose(got, expected, atol=0.03), (kwargs, got, expected)


# --------------------------------------------------------------------------- logit adjustments
# A bias that makes the toy repeat token 65, alone and with each penalty against it.
BIAS = {"logit_bias": {65: 6.0}}
ADJUSTMENTS = {
    "bias": BIAS,
    "repetition": {**BIAS, "repetition_penalty": 1.8},
    "frequency": {**BIAS, "frequency_penalty": 1.0},
    "presence": {**BIAS, "presence_penalty": 2.0},
    "all": {
        "logit_bias": {65: 10.0, 66: -100.0},
        "repetition_penalty": 1.3,
        "frequency_penalty": 0.6,
        "presence_penalty": -0.4,
    },
}


def _reference_adjusted_greedy(toy_config, toy_state, prompt, max_tokens, adjustments):
    """Fixed-depth greedy decoding from a dense forward of the whole sequence at every step
    (LAST_EXITED at full depth is exactly that), each step's logits adjusted by the plain
    per-token reference of tests/unit/test_penalties.py."""
    from tests.reference.oracle import reference_dense_logits
    from tests.unit.test_penalties import reference_adjust

    outputs: list[int] = []
    for _ in range(max_tokens):
        logits = reference_dense_logits(toy_config, toy_state, prompt + outputs)[-1]
        adjusted = reference_adjust(
            logits,
            prompt,
            outputs,
            adjustments.get("repetition_penalty", 1.0),
            adjustments.get("frequency_penalty", 0.0),
            adjustments.get("presence_penalty", 0.0),
            adjustments.get("logit_bias", {}),
        )
        outputs.append(int(adjusted.argmax()))
    return outputs


@pytest.mark.parametrize("name", list(ADJUSTMENTS))
def test_logit_adjustments_equal_the_reference(make_engine, toy_config, toy_state, name):
    """Greedy decoding with each adjustment (prompt of one chunk and a half, async on) equals
    the reference, changes the plain greedy text, and leaves a request without adjustments
    in the same passes untouched."""
    adjustments = ADJUSTMENTS[name]
    params = SamplingParams(
        max_tokens=10, temperature=0.0, exit_threshold=1.0, ignore_eos=True, **adjustments
    )
    plain = replace(params, **{k: SamplingParams().__dict__[k] for k in adjustments})
    engine = make_engine(prefill_chunk_size=4, async_scheduling=True)
    outputs = drain(
        engine, {0: [("adjusted", PROMPT + [65, 65], params), ("plain", PROMPT, plain)]}
    )
    want = _reference_adjusted_greedy(toy_config, toy_state, PROMPT + [65, 65], 10, adjustments)
    assert outputs["adjusted"].outputs[0].token_ids == want
    # Each adjustment matters here: the bias against plain greedy, a penalty against the bias.
    baseline = {} if name in ("bias", "all") else BIAS
    assert want != _reference_adjusted_greedy(
        toy_config, toy_state, PROMPT + [65, 65], 10, baseline
    )
    assert outputs["plain"].outputs[0].token_ids == _greedy_tokens(make_engine, 10)


def test_adjusted_requests_resume_with_their_counts(make_engine, toy_config, toy_state):
    """A pool that preempts: the frequency counts of a resumed request include the tokens it
    made before, so its output still equals the reference."""
    adjustments = ADJUSTMENTS["all"]
    params = SamplingParams(
        max_tokens=14, temperature=0.0, exit_threshold=1.0, ignore_eos=True, **adjustments
    )
    engine = make_engine(num_blocks=8, block_size=4, prefill_chunk_size=4, max_num_seqs=3)
    prompts = {f"r{i}": PROMPT[: 2 + i] for i in range(3)}
    outputs = drain(engine, {0: [(rid, prompt, params) for rid, prompt in prompts.items()]})
    assert engine.scheduler.num_preemptions > 0
    for rid, prompt in prompts.items():
        want = _reference_adjusted_greedy(toy_config, toy_state, prompt, 14, adjustments)
        assert outputs[rid].outputs[0].token_ids == want, rid


# --------------------------------------------------------------------------- allowed token ids
def test_allowed_token_ids_restrict_every_token_and_no_bias_lets_another_in(
    make_engine, toy_config, toy_state
):
    """Greedy with allowed_token_ids is the reference's argmax over the allowed tokens alone
    (a bias on a barred token changes nothing); sampled tokens, the first one (from the
    prompt) included, are allowed ones; a request beside them is untouched."""
    from tests.reference.oracle import reference_dense_logits

    allowed = [66, 70, 101, 250]
    restricted = dict(allowed_token_ids=allowed, logit_bias={65: 100.0}, ignore_eos=True)
    greedy = SamplingParams(max_tokens=8, temperature=0.0, exit_threshold=1.0, **restricted)
    sampled = SamplingParams(max_tokens=8, temperature=1.0, seed=5, **restricted)
    plain = SamplingParams(max_tokens=8, temperature=0.0, exit_threshold=1.0)
    engine = make_engine(prefill_chunk_size=4, async_scheduling=True)
    outputs = drain(
        engine,
        {0: [("greedy", PROMPT, greedy), ("sampled", PROMPT, sampled), ("plain", PROMPT, plain)]},
    )
    want: list[int] = []
    for _ in range(8):
        logits = reference_dense_logits(toy_config, toy_state, PROMPT + want)[-1]
        want.append(allowed[int(logits[allowed].argmax())])
    assert outputs["greedy"].outputs[0].token_ids == want
    assert set(outputs["sampled"].outputs[0].token_ids) <= set(allowed)
    assert outputs["plain"].outputs[0].token_ids == _greedy_tokens(make_engine, 8)
    assert want != outputs["plain"].outputs[0].token_ids  # the restriction matters here


def test_allowed_token_ids_are_checked(make_engine):
    engine = make_engine()
    vocab = engine.model.config.vocab_size
    bad = [
        ([], "allowed_token_ids must be a non-empty list"),
        ([3, -1], r"allowed_token_ids\[1\] must be a token id in \[0, vocab_size - 1\]"),
        (
            [3, vocab],
            rf"allowed_token_ids\[1\] must be a token id in \[0, {vocab - 1}\], got {vocab}",
        ),
    ]
    for value, message in bad:
        with pytest.raises(ValueError, match=message) as caught:
            frontend(engine).add_request("r", [5, 6], SamplingParams(allowed_token_ids=value))
        assert caught.value.param == "allowed_token_ids"
    eos = sorted(engine.eos_token_ids)[0]
    nothing_left = SamplingParams(allowed_token_ids=[eos, 9], stop_token_ids=[9], min_tokens=2)
    with pytest.raises(ValueError, match="nothing could be sampled"):
        frontend(engine).add_request("r", [5, 6], nothing_left)
    assert not engine.has_unfinished and engine.all_blocks_free()


# --------------------------------------------------------------------------- bad words
def _reference_without(toy_config, toy_state, prompt, count, words) -> list[int]:
    """Greedy over the reference logits, each word's last token barred where the output
    so far ends with the rest of it."""
    from tests.reference.oracle import reference_dense_logits

    out: list[int] = []
    for _ in range(count):
        logits = reference_dense_logits(toy_config, toy_state, prompt + out)[-1].clone()
        for word in words:
            if len(word) == 1 or out[-(len(word) - 1) :] == list(word[:-1]):
                logits[word[-1]] = float("-inf")
        out.append(int(logits.argmax()))
    return out


def test_bad_words_are_never_completed(make_engine, toy_config, toy_state):
    """Greedy with bad words equals the reference that bars each word's last token after
    the rest of it (a one-token word always), also for a request resumed after preemption
    (its last outputs are restored); a request beside them is untouched."""
    plain_tokens = _greedy_tokens(make_engine, 10)
    pair = plain_tokens[2:4]  # the plain output contains this pair: it must not come back
    words = [pair, [plain_tokens[6]]]
    params = SamplingParams(
        max_tokens=10,
        temperature=0.0,
        exit_threshold=1.0,
        ignore_eos=True,
        bad_words_token_ids=words,
    )
    plain = SamplingParams(max_tokens=10, temperature=0.0, exit_threshold=1.0)
    want = _reference_without(toy_config, toy_state, PROMPT, 10, words)
    assert want != plain_tokens
    engine = make_engine(prefill_chunk_size=4, async_scheduling=True)
    outputs = drain(engine, {0: [("banned", PROMPT, params), ("plain", PROMPT, plain)]})
    assert outputs["banned"].outputs[0].token_ids == want
    assert outputs["plain"].outputs[0].token_ids == plain_tokens
    small = make_engine(num_blocks=8, block_size=4, prefill_chunk_size=4, max_num_seqs=3)
    prompts = {f"r{i}": PROMPT[: 2 + i] for i in range(3)}
    outputs = drain(small, {0: [(rid, prompt, params) for rid, prompt in prompts.items()]})
    assert small.scheduler.num_preemptions > 0
    for rid, prompt in prompts.items():
        want = _reference_without(toy_config, toy_state, prompt, 10, words)
        assert outputs[rid].outputs[0].token_ids == want, rid


def test_bad_words_are_checked(make_engine):
    from vllm_rlt.engine.llm_engine import LLMEngine

    engine = make_engine()
    vocab = engine.model.config.vocab_size
    bad = [
        (dict(bad_words=[]), "bad_words must be a list of 1 to 32 strings"),
        (dict(bad_words=["ok", " "]), "bad_words must hold non-blank strings"),
        (dict(bad_words=["x"] * 33), "bad_words must be a list of 1 to 32 strings"),
        (dict(bad_words_token_ids=[[1] * 9]), "each bad word must be 1 to 8 tokens, got 9"),
        (
            dict(bad_words_token_ids=[[3, vocab]]),
            rf"bad_words_token_ids\[0\]\[1\] must be a token id in \[0, {vocab - 1}\], got {vocab}",
        ),
    ]
    for fields, message in bad:
        with pytest.raises(ValueError, match=message) as caught:
            frontend(engine).add_request("r", [5, 6], SamplingParams(**fields))
        assert caught.value.param == "bad_words"
    with pytest.raises(ValueError, match="bad_words needs the model's tokenizer"):
        LLMEngine(engine, None).add_request("r", [5, 6], SamplingParams(bad_words=["ab"]))
    with pytest.raises(ValueError, match="bad_words are turned into token ids by the frontend"):
        engine.add_request("r", [5, 6], SamplingParams(bad_words=["ab"]))
    assert not engine.has_unfinished and engine.all_blocks_free()


def test_bad_words_as_text_through_llm():
    """The built-in model answers 347+589= with 936; barring "936" (or "93") changes the
    answer, and the text never holds the word. A word may be 8 bytes long, not 9."""
    from vllm_rlt import LLM

    llm = LLM()
    greedy = dict(max_tokens=4, temperature=0.0)
    plain = llm.generate("347+589=", SamplingParams(**greedy), use_tqdm=False)[0]
    assert plain.outputs[0].text == "936"
    for word in ("936", "93"):
        params = SamplingParams(**greedy, bad_words=[word])
        text = llm.generate("347+589=", params, use_tqdm=False)[0].outputs[0].text
        assert word not in text and text != "936"
    # 8 bytes is the limit: the form with a leading space is a space before them (barred
    # with them), so only the form without one is kept and counted
    eight = llm.generate("1+1=", SamplingParams(**greedy, bad_words=["x" * 8]), use_tqdm=False)
    assert "x" * 8 not in eight[0].outputs[0].text
    nine = "bad word 'xxxxxxxxx' is 9 tokens without a leading space; at most 8"
    with pytest.raises(ValueError, match=nine) as caught:
        llm.generate("1+1=", SamplingParams(bad_words=["x" * 9]), use_tqdm=False)
    assert caught.value.param == "bad_words"
