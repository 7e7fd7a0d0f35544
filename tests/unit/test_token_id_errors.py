"""Offline errors for a bad token id name the entry ("stop_token_ids[2]", the offline API's
spelling) and its true range: in words where SamplingParams cannot know the vocabulary, the
model's where the engine checks a request; a huge integer is shortened in any message."""

from __future__ import annotations

import re
from typing import Any

import pytest

from tests.conftest import frontend
from vllm_rlt import LLM, SamplingParams
from vllm_rlt.config import ParamError, shown_int

VOCAB = 259  # the toy's vocab_size (byte tokenizer)
HUGE = 10**30


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(model="toy")


def raised(call: Any, *args: Any, **kwargs: Any) -> ParamError:
    with pytest.raises(ParamError) as error:
        call(*args, **kwargs)
    return error.value


@pytest.mark.parametrize(
    ("kwargs", "entry", "got"),
    [
        ({"stop_token_ids": [5, 6, -1]}, "stop_token_ids[2]", "-1"),
        ({"stop_token_ids": [2**31]}, "stop_token_ids[0]", str(2**31)),
        ({"stop_token_ids": [5, True]}, "stop_token_ids[1]", "True"),
        ({"stop_token_ids": [HUGE]}, "stop_token_ids[0]", "10000000000000000000..."),
        ({"allowed_token_ids": [3, "4"]}, "allowed_token_ids[1]", "'4'"),
        ({"bad_words_token_ids": [[1], [2, -1]]}, "bad_words_token_ids[1][1]", "-1"),
    ],
)
def test_sampling_params_name_the_entry_and_the_vocabulary_in_words(
    kwargs: dict[str, Any], entry: str, got: str
) -> None:
    """SamplingParams knows no model: the range is the vocabulary's, said in words, not
    int32's [0, 2147483647]. The param is the field, as the other offline errors give it."""
    error = raised(SamplingParams, **kwargs)
    assert str(error) == f"{entry} must be a token id in [0, vocab_size - 1], got {got}"
    field = next(iter(kwargs))
    assert error.param == ("bad_words" if field == "bad_words_token_ids" else field)


def test_a_logit_bias_key_is_named_with_the_vocabulary_in_words() -> None:
    error = raised(SamplingParams, logit_bias={3: 1.0, -1: 2.0})
    assert str(error) == "logit_bias key -1 must be a token id in [0, vocab_size - 1]"
    assert error.param == "logit_bias"


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("stop_token_ids", [5, 6, -1], "stop_token_ids[2] must be a token id in [0, 258], got -1"),
        ("allowed_token_ids", [-3], "allowed_token_ids[0] must be a token id in [0, 258], got -3"),
        (
            "bad_words_token_ids",
            [[1], [-2]],
            "bad_words_token_ids[1][0] must be a token id in [0, 258], got -2",
        ),
        ("logit_bias", {-4: 1.0}, "logit_bias key -4 must be a token id in [0, 258]"),
    ],
)
def test_the_engine_gives_the_models_range_for_an_entry_edited_in(
    make_engine: Any, field: str, value: Any, message: str
) -> None:
    """Params edited after they were made reach the engine's checks unchecked (the core API
    takes them as they are): those check the low end too, with the model's range."""
    engine = make_engine()
    params = SamplingParams(max_tokens=2)
    setattr(params, field, value)
    error = raised(frontend(engine).add_request, "r", [5, 6], params)
    assert str(error) == message
    assert not engine.has_unfinished


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("stop_token_ids", [5, 6, VOCAB], "stop_token_ids[2] must be a token id in [0, 258]"),
        ("allowed_token_ids", [VOCAB], "allowed_token_ids[0] must be a token id in [0, 258]"),
        ("bad_words_token_ids", [[1, VOCAB]], "bad_words_token_ids[0][1] must be a token id"),
    ],
)
def test_llm_names_an_entry_past_the_vocabulary(
    llm: LLM, field: str, value: Any, message: str
) -> None:
    error = raised(llm.generate, [[5, 6]], SamplingParams(**{field: value}), use_tqdm=False)
    assert str(error).startswith(message) and str(error).endswith(f", got {VOCAB}")
    assert not llm.engine.has_unfinished and llm.engine.all_blocks_free()


def test_a_prompt_token_is_named_by_its_index(llm: LLM) -> None:
    error = raised(llm.generate, [[5, 6, -1]], SamplingParams(max_tokens=2), use_tqdm=False)
    assert str(error) == f"prompt_token_ids[2] must be a token id in [0, {VOCAB - 1}], got -1"
    assert error.param == "prompt"


def test_a_huge_max_tokens_is_shortened_in_the_context_error(llm: LLM) -> None:
    error = raised(llm.generate, [[5, 6]], SamplingParams(max_tokens=HUGE), use_tqdm=False)
    assert str(error).startswith(
        "prompt (2 tokens) + max_tokens (10000000000000000000...) = 10000000000000000000... "
        "exceeds the context length"
    )
    assert error.param == "max_tokens" and str(HUGE) not in str(error)


@pytest.mark.parametrize(
    "value",
    [10**20, -(10**20), 10**5000, -(10**9000) + 7],
    ids=["1e20", "-1e20", "1e5000", "-1e9000+7"],
)
def test_shown_int_keeps_a_huge_integers_first_20_digits(value: int) -> None:
    """Past Python's 4300 digits too, which str() refuses."""
    digits = re.fullmatch(r"(-?)([0-9]{20})\.\.\.", shown_int(value))
    assert digits is not None
    assert digits.group(1) == ("-" if value < 0 else "")
    assert digits.group(2) == ("1" + "0" * 19 if abs(value) % 10 == 0 else "9" * 20)
    assert shown_int(10**20 - 1) == "9" * 20


OVERLONG = 10**5000  # beyond the 4,300 digits Python turns into text


@pytest.mark.parametrize(
    ("kwargs", "param", "start"),
    [
        ({"n": OVERLONG}, "n", "n must be in [1, "),
        ({"max_tokens": OVERLONG}, "max_tokens", "max_tokens must be >= 1"),
        ({"top_k": -OVERLONG}, "top_k", "top_k must be 0 or -1 (every token)"),
        ({"temperature": OVERLONG}, "temperature", "temperature must be in [0.0, "),
        ({"best_of": OVERLONG}, "best_of", "best_of must be None or equal to n"),
        ({"stop_token_ids": [1, OVERLONG]}, "stop_token_ids", "stop_token_ids[1] must be a token"),
        ({"logit_bias": {OVERLONG: 1.0}}, "logit_bias", "logit_bias key must be a token id"),
        ({"logit_bias": {1: OVERLONG}}, "logit_bias", "logit_bias value must be in [-100.0, "),
        (
            {"bad_words_token_ids": [[1], [2, OVERLONG]]},
            "bad_words_token_ids",
            "bad_words_token_ids[1][1] must be a token id",
        ),
    ],
    ids=["n", "max_tokens", "top_k", "temperature", "best_of", "stop", "bias_key", "bias", "bad"],
)
def test_an_integer_too_long_to_print_names_its_field(kwargs, param, start) -> None:
    """Python refuses to print an int of over 4,300 digits: the field is named, not that."""
    error = raised(SamplingParams, **kwargs)
    assert error.param == param
    assert str(error).startswith(start), str(error)
    assert "digits" in str(error) and len(str(error)) < 150
