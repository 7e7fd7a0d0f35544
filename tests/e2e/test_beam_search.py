"""`LLM.beam_search` on the toy, as vLLM's: ranked beams against an exhaustive two-step
search made from plain `generate` calls, width one against greedy decoding, EOS and the
context ending beams, and every bad setting named. Each test leaves the engine idle."""

from __future__ import annotations

import math

import pytest

from vllm_rlt import LLM, SamplingParams
from vllm_rlt.beam_search import BeamSearchSequence, beam_score
from vllm_rlt.config import ParamError
from vllm_rlt.engine.beam_search import BeamLimits, beam_search
from vllm_rlt.sampling_params import BeamSearchParams

PROMPT = [5, 6, 7]


def _top(llm: LLM, ids: list[int], k: int) -> list[tuple[int, float]]:
    """The k most likely next tokens after `ids` with their logprobs, most likely first."""
    params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=k, ignore_eos=True)
    ranked = llm.generate([ids], params, use_tqdm=False)[0].outputs[0].logprobs[0]
    pairs = sorted(((t, p.logprob) for t, p in ranked.items()), key=lambda x: -x[1])
    return pairs[:k]


def test_two_steps_match_an_exhaustive_search(llm):
    width = 3
    out = llm.beam_search(
        [PROMPT], BeamSearchParams(beam_width=width, max_tokens=2, ignore_eos=True)
    )
    # Every two-token continuation through the most likely first tokens, ranked by sum.
    paths = []
    for first, lp1 in _top(llm, PROMPT, width):
        for second, lp2 in _top(llm, [*PROMPT, first], 2 * width):
            paths.append(([first, second], lp1 + lp2))
    paths.sort(key=lambda x: -x[1])
    got = out[0].sequences
    assert [s.token_ids for s in got] == [p[0] for p in paths[:width]]
    for seq, (_, total) in zip(got, paths, strict=False):
        assert seq.cum_logprob == pytest.approx(total, abs=1e-5)
        assert seq.tokens[: len(PROMPT)] == PROMPT and seq.finish_reason == "length"


def test_width_one_is_greedy_decoding(llm):
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=0)
    want = llm.generate([PROMPT], greedy, use_tqdm=False)[0].outputs[0]
    got = llm.beam_search(PROMPT, BeamSearchParams(1, 6, ignore_eos=True))[0].sequences
    assert len(got) == 1
    assert got[0].token_ids == want.token_ids
    assert got[0].cum_logprob == pytest.approx(want.cumulative_logprob, abs=1e-4)


def test_beams_are_distinct_ranked_and_carry_their_steps(llm):
    width, steps = 4, 5
    params = BeamSearchParams(beam_width=width, max_tokens=steps, ignore_eos=True)
    outs = llm.beam_search(["hello world", {"prompt_token_ids": PROMPT}], params)
    assert len(outs) == 2
    eos = llm.llm_engine.processor.eos_token_ids
    for out in outs:
        seqs = out.sequences
        assert len(seqs) == width
        assert len({tuple(s.tokens) for s in seqs}) == width
        scores = [beam_score(s, eos, 1.0) for s in seqs]
        assert scores == sorted(scores, reverse=True)
        for seq in seqs:
            assert len(seq.token_ids) == steps == len(seq.logprobs)
            # Greedy steps rank 2 x width candidates; the chosen token is one of them.
            assert all(len(step) == 2 * width for step in seq.logprobs)
            picked = [step[t].logprob for step, t in zip(seq.logprobs, seq.token_ids, strict=True)]
            assert seq.cum_logprob == pytest.approx(sum(picked))
            assert seq.text == llm.tokenizer.decode(seq.tokens, skip_special_tokens=False)
    assert outs[0].sequences[0].text.startswith("hello world")


def test_an_eos_token_ends_a_beam_unless_ignored(llm):
    first = _top(llm, PROMPT, 1)[0][0]
    limits = BeamLimits(frozenset({first}), longest_prompt=10_000, decode=None)

    def step(batch, params):
        return llm.generate(batch, params, use_tqdm=False)

    ended = beam_search([PROMPT], BeamSearchParams(2, 3), step, limits)[0].sequences
    stopped = [s for s in ended if s.finish_reason == "stop"]
    assert [s.token_ids for s in stopped] == [[first]]
    # Scored without the EOS: its length is the prompt's.
    assert beam_score(stopped[0], limits.eos_token_ids, 1.0) == stopped[0].cum_logprob / 3
    assert all(s.text is None for s in ended)
    kept = beam_search([PROMPT], BeamSearchParams(2, 3, ignore_eos=True), step, limits)
    assert all(s.finish_reason == "length" and len(s.token_ids) == 3 for s in kept[0].sequences)


def test_the_context_ends_beams_instead_of_failing():
    llm = LLM(model="toy", max_model_len=12, skip_tokenizer_init=True)
    out = llm.beam_search([list(range(3, 11))], BeamSearchParams(2, 50, ignore_eos=True))
    seqs = out[0].sequences
    assert [len(s.tokens) for s in seqs] == [12, 12]
    assert all(s.finish_reason == "length" and s.text is None for s in seqs)
    with pytest.raises(ParamError, match="prompt"):
        llm.beam_search([list(range(3, 15))], BeamSearchParams(2, 5))
    assert not llm.engine.has_unfinished and llm.engine.all_blocks_free()


def test_concurrency_limit_and_progress_bar(llm, capsys):
    prompts = [PROMPT, [9, 8], [4, 4, 4, 4]]
    params = BeamSearchParams(2, 3, ignore_eos=True)
    together = llm.beam_search(prompts, params)
    apart = llm.beam_search(prompts, params, use_tqdm=True, concurrency_limit=1)
    assert [[s.tokens for s in o.sequences] for o in apart] == [
        [s.tokens for s in o.sequences] for o in together
    ]
    assert "Beam search" in capsys.readouterr().err


def test_sampled_steps_add_the_drawn_token(llm):
    params = BeamSearchParams(2, 4, ignore_eos=True, temperature=1.0)
    seqs = llm.beam_search([PROMPT], params)[0].sequences
    assert len(seqs) == 2
    assert all(len(step) in (4, 5) for seq in seqs for step in seq.logprobs)


@pytest.mark.parametrize(
    ("fields", "field", "message"),
    [
        ({"beam_width": 0}, "beam_width", r"in \[1, 10\], got 0"),
        ({"beam_width": 11}, "beam_width", r"in \[1, 10\], got 11"),
        ({"beam_width": True}, "beam_width", "integer"),
        ({"max_tokens": 0}, "max_tokens", ">= 1, got 0"),
        ({"max_tokens": 2.0}, "max_tokens", "integer"),
        ({"temperature": math.nan}, "temperature", r"\[0.0, 100.0\], got nan"),
        ({"temperature": -1}, "temperature", r"\[0.0, 100.0\]"),
        ({"length_penalty": math.inf}, "length_penalty", "finite number, got inf"),
        ({"length_penalty": "1"}, "length_penalty", "finite number"),
        ({"ignore_eos": 1}, "ignore_eos", "True or False"),
        ({"include_stop_str_in_output": None}, "include_stop_str_in_output", "True or False"),
    ],
)
def test_bad_settings_are_named(fields, field, message):
    kwargs = {"beam_width": 2, "max_tokens": 4, **fields}
    with pytest.raises(ParamError, match=message) as caught:
        BeamSearchParams(**kwargs)
    assert caught.value.param == field


def test_bad_calls_are_named(llm):
    params = BeamSearchParams(2, 2)
    with pytest.raises(ParamError, match="params must be a BeamSearchParams, got SamplingParams"):
        llm.beam_search([PROMPT], SamplingParams())
    with pytest.raises(ParamError, match="lora_request"):
        llm.beam_search([PROMPT], params, lora_request=object())
    with pytest.raises(ParamError, match="concurrency_limit must be >= 1, got 0"):
        llm.beam_search([PROMPT], params, concurrency_limit=0)
    with pytest.raises(ParamError, match="token"):
        llm.beam_search([[5, 10**9]], params)


def test_sequence_ids_without_the_prompt():
    seq = BeamSearchSequence(tokens=[1, 2, 3, 4], prompt_len=3)
    assert seq.token_ids == [4]
