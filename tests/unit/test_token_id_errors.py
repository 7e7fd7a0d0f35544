"""Offline errors for a bad token id name the entry ("stop_token_ids[2]", the offline API's
spelling) and its true range: in words where SamplingParams cannot know the vocabulary, the
model's where the engine checks a request; a huge integer is shortened in any message."""

from __future__ import annotations

import re
from typing import Any

import pytest

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
