"""Constraint sets that leave nothing to sample: `check_samplable` refuses a request exactly
when some step it can reach has no token left, against a search over every output."""

from __future__ import annotations

import random

import pytest

from vllm_rlt.config import ParamError
from vllm_rlt.engine.samplable import check_samplable
from vllm_rlt.sampling_params import SamplingParams

EOS = frozenset({0})


def first_empty_step(params: SamplingParams, vocab: int, eos: frozenset[int]) -> int | None:
    """The output length at which some output the request can make has nothing left to
    sample, trying every output (None: never)."""
    pool = set(params.allowed_token_ids or range(vocab))
    ending = set(params.stop_token_ids) | (set() if params.ignore_eos else eos)
    words = [tuple(w) for w in params.bad_words_token_ids or ()]

    def search(output: tuple[int, ...]) -> int | None:
        if len(output) >= params.max_tokens:
            return None
        barred = {w[-1] for w in words if len(w) == 1 or output[-(len(w) - 1) :] == w[:-1]}
        left = pool - barred - (ending if len(output) < params.min_tokens else set())
        if not left:
            return len(output)
        found = [search(output + (token,)) for token in sorted(left - ending)]
        return min((step for step in found if step is not None), default=None)

    return search(())


def refusal(params: SamplingParams, vocab: int = 6, eos: frozenset[int] = EOS) -> ParamError:
    with pytest.raises(ParamError, match="nothing could be sampled") as caught:
        check_samplable(params, vocab, eos)
    return caught.value


def test_a_bad_word_that_bars_the_only_allowed_token_is_refused_at_the_first_token():
    for extra in ({}, {"n": 8}, {"top_k": 1, "top_p": 0.5}, {"min_tokens": 3}, {"seed": 1}):
        params = SamplingParams(allowed_token_ids=[3], bad_words_token_ids=[[3]], **extra)
        error = refusal(params)
        assert error.param == "allowed_token_ids"
        assert str(error) == (
            "nothing could be sampled at the first token: of allowed_token_ids [3], "
            "bad_words bar [3]"
        )
    # one allowed token left over is enough, and no bias lets a barred one back
    check_samplable(SamplingParams(allowed_token_ids=[3, 4], bad_words_token_ids=[[3]]), 6, EOS)


def test_a_longer_word_empties_the_set_only_where_the_output_can_end_with_its_start():
    """[3, 3] bars 3 after a 3: with only 3 allowed, the second token has nothing left;
    with max_tokens 1 there is no second token, and a word whose start is not allowed
    never matches."""
    repeat = dict(allowed_token_ids=[3], bad_words_token_ids=[[3, 3]])
    error = refusal(SamplingParams(max_tokens=2, **repeat))
    assert "after 1 token, once the output ends with the tokens [3]" in str(error)
    assert "bad_words bar [3]" in str(error) and error.param == "allowed_token_ids"
    check_samplable(SamplingParams(max_tokens=1, **repeat), 6, EOS)
    check_samplable(SamplingParams(allowed_token_ids=[3], bad_words_token_ids=[[4, 3]]), 6, EOS)
    # 3 and 4 may alternate for ever; with [3, 4, 3] too, 3 4 leaves nothing
    alternate = dict(allowed_token_ids=[3, 4], bad_words_token_ids=[[3, 3], [4, 4]])
    check_samplable(SamplingParams(max_tokens=50, **alternate), 6, EOS)
    chain = dict(allowed_token_ids=[3, 4], bad_words_token_ids=[[3, 3], [3, 4, 3], [4, 4]])
    assert "after 2 tokens" in str(refusal(SamplingParams(max_tokens=3, **chain)))
    check_samplable(SamplingParams(max_tokens=2, **chain), 6, EOS)


def test_min_tokens_with_only_eos_and_stop_ids_allowed_is_refused():
    params = SamplingParams(allowed_token_ids=[0, 5], stop_token_ids=[5], min_tokens=1)
    error = refusal(params)
    assert error.param == "allowed_token_ids"
    assert "min_tokens (1) bans the EOS and stop token ids [0, 5]" in str(error)
    check_samplable(SamplingParams(allowed_token_ids=[0, 5], stop_token_ids=[5]), 6, EOS)
    ignored = SamplingParams(allowed_token_ids=[0], min_tokens=1, ignore_eos=True)
    check_samplable(ignored, 6, EOS)
    # bad words and min_tokens together: 4 is barred, 0 banned until one token is out
    both = SamplingParams(allowed_token_ids=[0, 4], bad_words_token_ids=[[4]], min_tokens=1)
    assert "bad_words bar [4] and min_tokens (1) bans" in str(refusal(both))
    # without allowed_token_ids only a vocabulary of stop ids empties a step
    error = refusal(SamplingParams(stop_token_ids=[1, 2, 3, 4, 5], min_tokens=1))
    assert error.param == "min_tokens" and "of the vocabulary" in str(error)
    error = refusal(SamplingParams(bad_words_token_ids=[[t] for t in range(6)]))
    assert error.param == "bad_words"


def test_an_eos_that_ends_the_output_is_never_followed():
    """A word that starts with EOS can only match once EOS no longer ends the output."""
    params = dict(allowed_token_ids=[0, 3], bad_words_token_ids=[[0, 3], [0, 0]])
    check_samplable(SamplingParams(**params), 6, EOS)
    assert "after 1 token" in str(refusal(SamplingParams(ignore_eos=True, **params)))


@pytest.mark.parametrize("seed", range(4))
def test_refused_exactly_when_some_output_leaves_nothing(seed):
    rng = random.Random(seed)
    vocab = 6
    refused = 0
    for _ in range(150):
        words = [
            [rng.randrange(vocab) for _ in range(rng.choice((1, 1, 2, 2, 3)))]
            for _ in range(rng.randrange(1, 6))
        ]
        allowed = rng.sample(range(vocab), rng.randrange(1, 4)) if rng.random() < 0.8 else None
        max_tokens = rng.randrange(1, 6)
        params = SamplingParams(
            max_tokens=max_tokens,
            min_tokens=rng.randrange(max_tokens + 1),
            allowed_token_ids=allowed,
            bad_words_token_ids=words,
            stop_token_ids=[rng.randrange(vocab)] if rng.random() < 0.3 else [],
            ignore_eos=rng.random() < 0.3,
        )
        step = first_empty_step(params, vocab, EOS)
        if step is None:
            check_samplable(params, vocab, EOS)
            continue
        refused += 1
        error = refusal(params, vocab)
        assert ("at the first token" in str(error)) == (step == 0), (params, step)
        assert step == 0 or f"after {step} token" in str(error), (params, step)
    assert 10 < refused < 140  # both outcomes are well covered
