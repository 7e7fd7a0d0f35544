"""Stopping on the toy: stop strings, stop ids, min_tokens, max_tokens, ignore_eos, and the
per-token exit depths (docs/design.md §3.6). Stop targets are taken from an earlier greedy
run, since the toy's text is noise."""

from __future__ import annotations

from tests.conftest import drain
from vllm_rlt import SamplingParams
from vllm_rlt.tokenizer import Tokenizer

PROMPT = [107, 104, 111, 114, 90]  # "hello" (bytes + 3)
EARLY_EOS_PROMPT = [64, 203, 49, 192]  # greedy samples <|im_end|> (id 2) first
EOS_IDS = {0, 2}


def _run(make_engine, params: SamplingParams, prompt=PROMPT):
    """The finished completion of `prompt` alone on a fresh engine."""
    return drain(make_engine(), {0: [("r", prompt, params)]})["r"].outputs[0]


def _greedy(make_engine, max_tokens: int = 24, prompt=PROMPT, **kwargs):
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kwargs)
    return _run(make_engine, params, prompt)


def _printable(text: str, size: int = 2) -> tuple[str, int]:
    """A printable ASCII stop string of `size` characters and the index of its first
    occurrence, chosen past the start so some text comes before it."""
    for index in range(1, len(text) - size + 1):
        piece = text[index : index + size]
        if all(ch.isascii() and ch.isprintable() for ch in piece) and text.find(piece) == index:
            return piece, index
    raise AssertionError(f"no printable {size}-character piece in {text!r}")


def test_stop_string_ends_request_and_is_excluded(make_engine):
    full = _greedy(make_engine)
    stop, index = _printable(full.text)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, stop=stop)
    stopped = _run(make_engine, params)
    assert stopped.finish_reason == "stop"
    assert stopped.text == full.text[:index]
    assert stop not in stopped.text
    count = len(stopped.token_ids)
    assert count < len(full.token_ids)
    assert stopped.token_ids == full.token_ids[:count]
    # The request stopped at the very token that completed the stop string.
    tokenizer = Tokenizer.byte_level()
    assert stop in tokenizer.decode(stopped.token_ids)
    assert stop not in tokenizer.decode(stopped.token_ids[:-1])


def test_earliest_of_several_stop_strings_wins(make_engine):
    full = _greedy(make_engine)
    first, index = _printable(full.text)
    second, _ = _printable(full.text[index + 2 :], size=1)
    assert second != first
    cut = min(full.text.find(first), full.text.find(second))
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, stop=[second, first])
    stopped = _run(make_engine, params)
    assert stopped.finish_reason == "stop" and stopped.text == full.text[:cut]


def test_stop_string_in_the_prompt_does_not_stop(make_engine):
    """Only generated text is searched, even though the prompt's tail is detokenizer context."""
    full = _greedy(make_engine, max_tokens=12)
    assert "ello" not in full.text
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, stop="ello")
    kept = _run(make_engine, params)
    assert kept.finish_reason == "length" and kept.token_ids == full.token_ids


def test_stop_token_id_is_included(make_engine):
    full = _greedy(make_engine).token_ids
    target = full[4]
    first = full.index(target)
    params = SamplingParams(
        max_tokens=24, temperature=0.0, ignore_eos=True, stop_token_ids=[target]
    )
    stopped = _run(make_engine, params)
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids == full[: first + 1]


def test_min_tokens_suppresses_stop_ids(make_engine):
    """The greedy first token is a stop id: before min_tokens it may not be sampled at all."""
    full = _greedy(make_engine, max_tokens=8).token_ids
    params = SamplingParams(
        max_tokens=8, min_tokens=4, temperature=0.0, ignore_eos=True, stop_token_ids=[full[0]]
    )
    completion = _run(make_engine, params)
    assert len(completion.token_ids) >= 4
    assert full[0] not in completion.token_ids[:4]
    if completion.finish_reason == "stop":
        assert completion.token_ids[-1] == full[0] and len(completion.token_ids) > 4
    # Without min_tokens the same request stops at once.
    params = SamplingParams(max_tokens=8, temperature=0.0, stop_token_ids=[full[0]])
    assert _run(make_engine, params).token_ids == [full[0]]


def test_min_tokens_suppresses_eos(make_engine):
    """EARLY_EOS_PROMPT ends immediately with EOS unless min_tokens holds EOS back."""
    eager = _run(make_engine, SamplingParams(max_tokens=8, temperature=0.0), EARLY_EOS_PROMPT)
    assert eager.finish_reason == "stop" and eager.token_ids[-1] in EOS_IDS
    assert len(eager.token_ids) < 3
    params = SamplingParams(max_tokens=8, min_tokens=3, temperature=0.0, logprobs=5)
    held = _run(make_engine, params, EARLY_EOS_PROMPT)
    assert len(held.token_ids) >= 3
    assert not EOS_IDS & set(held.token_ids[:3])
    # Masked before min_tokens: EOS is not even among the top alternatives there.
    assert all(not EOS_IDS & set(entry) for entry in held.logprobs[:3])


def test_max_tokens_gives_length(make_engine):
    completion = _run(make_engine, SamplingParams(max_tokens=5, temperature=0.0))
    assert completion.finish_reason == "length"
    assert len(completion.token_ids) == 5


def test_ignore_eos_runs_to_max_tokens(make_engine):
    eager = _run(make_engine, SamplingParams(max_tokens=6, temperature=0.0), EARLY_EOS_PROMPT)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    ignoring = _run(make_engine, params, EARLY_EOS_PROMPT)
    assert ignoring.finish_reason == "length" and len(ignoring.token_ids) == 6
    count = len(eager.token_ids)
    assert ignoring.token_ids[:count] == eager.token_ids  # the EOS is kept as an ordinary token


def test_exit_depths_one_per_token_first_is_full_depth(make_engine):
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, exit_threshold=0.5)
    completion = _run(make_engine, params)
    depths = completion.exit_depths
    assert len(depths) == len(completion.token_ids) == 10
    assert depths[0] == 4
    assert all(1 <= d <= 4 for d in depths)
    assert min(depths[1:]) < 4  # the adaptive threshold really exited early somewhere
    fixed = _run(make_engine, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    assert fixed.exit_depths == [4, 4, 4, 4]  # the toy's threshold 1.0 means full depth
