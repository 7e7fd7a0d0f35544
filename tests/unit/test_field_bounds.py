"""FIELD_BOUNDS is the one statement of each bounded sampling field: SamplingParams'
defaults and checks, the HTTP request bodies and `vllm-rlt generate`'s flags follow it."""

from __future__ import annotations

import dataclasses

import pytest
from pydantic import ValidationError

from vllm_rlt.config import ParamError
from vllm_rlt.entrypoints.cli import build_parser
from vllm_rlt.entrypoints.openai.protocol import ChatCompletionRequest
from vllm_rlt.entrypoints.openai.request_errors import describe_validation_error
from vllm_rlt.entrypoints.sampling_args import sampling_flags
from vllm_rlt.sampling_params import FIELD_BOUNDS, SamplingParams

DEFAULTS = {f.name: f.default for f in dataclasses.fields(SamplingParams)}


@pytest.mark.parametrize("name", sorted(FIELD_BOUNDS))
def test_sampling_params_default_and_range_follow_the_table(name):
    bound = FIELD_BOUNDS[name]
    assert DEFAULTS[name] == bound.default
    below = bound.low if bound.low_open else bound.low - 1
    with pytest.raises(ParamError, match=name) as caught:
        SamplingParams(**{name: bound.kind(below)})
    assert caught.value.param == name


@pytest.mark.parametrize("name", sorted(n for n, b in FIELD_BOUNDS.items() if b.http))
def test_http_field_follows_the_table(name):
    bound = FIELD_BOUNDS[name]
    field = ChatCompletionRequest.model_fields[name]
    assert field.default == bound.default
    below = bound.low if bound.low_open else bound.low - 1
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], name: below}
    with pytest.raises(ValidationError) as caught:
        ChatCompletionRequest.model_validate(body)
    message, param = describe_validation_error(caught.value.errors(), ChatCompletionRequest)
    assert param == name and f"{name}: must be in " in message


def test_every_cli_field_has_a_flag_and_an_unset_flag_stays_unset():
    parser = build_parser()
    ns = parser.parse_args(["generate", "--prompt", "x"])
    assert sampling_flags(ns) == {"max_tokens": 32}  # generate's own default
    for name, bound in FIELD_BOUNDS.items():
        if not bound.cli:
            continue
        flag = bound.flag or f"--{name.replace('_', '-')}"
        value = bound.default if bound.default is not None else bound.low
        ns = parser.parse_args(["generate", "--prompt", "x", flag, str(value)])
        assert sampling_flags(ns)[name] == value


def test_a_query_parameter_error_names_the_parameter_not_where_it_was_found():
    error = {"type": "int_parsing", "loc": ("query", "level"), "msg": "not an int", "input": "a"}
    message, param = describe_validation_error([error], None)
    assert param == "level" and message.startswith("level: ")
