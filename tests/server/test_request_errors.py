"""Bad request bodies get 400s that name the field and its true range: the loop fields are
bounded by the served model's depth, max_tokens by its context, a bad token id is named by
its path, and a body that is not a JSON object is told so."""

from __future__ import annotations

import json

import httpx
import pytest
from pydantic import ValidationError

from tests.server.conftest import BASES
from vllm_rlt.entrypoints.openai.api_errors import APIError
from vllm_rlt.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
)
from vllm_rlt.entrypoints.openai.request_errors import describe_validation_error

TOY_DEPTH = 4
TOY_VOCAB = 259
TOY_CONTEXT = 4096


def error_of(reply: httpx.Response, param: str | None) -> str:
    """The message of an OpenAI-style 400 whose param is `param`."""
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["code"] == 400 and error["type"] == "invalid_request_error"
    assert error["param"] == param, error
    return error["message"]


@pytest.mark.parametrize("path", BASES)
@pytest.mark.parametrize("field", ["min_loops", "max_loops"])
@pytest.mark.parametrize("value", [1.5, 2.0, -1, 0, TOY_DEPTH + 1, 2**63, "2", True])
def test_loop_fields_give_the_models_depth_as_their_range(server, path, field, value):
    url, _ = server
    reply = httpx.post(f"{url}{path}", json={**BASES[path], field: value})
    message = error_of(reply, field)
    assert message.startswith(field) and f"[1, {TOY_DEPTH}]" in message, message
    assert "inf" not in message


def test_loop_fields_within_the_depth_run(server):
    url, _ = server
    body = {**BASES["/v1/completions"], "min_loops": 2, "max_loops": TOY_DEPTH}
    assert httpx.post(f"{url}/v1/completions", json=body).status_code == 200


def test_exit_threshold_keeps_its_finite_range(server):
    url, _ = server
    for value in (1.5, -1, "0.5"):
        body = {**BASES["/v1/completions"], "exit_threshold": value}
        message = error_of(httpx.post(f"{url}/v1/completions", json=body), "exit_threshold")
        assert "[0.0, 1.0]" in message and "inf" not in message


def test_loop_fields_before_the_model_has_loaded_name_its_depth_in_words():
    with pytest.raises(ValidationError) as raised:
        CompletionRequest.model_validate({"model": "toy", "prompt": "x", "max_loops": 0})
    message, param = describe_validation_error(raised.value.errors(), CompletionRequest)
    assert param == "max_loops"
    assert message == "max_loops: must be in [1, the model's depth], got 0"


@pytest.mark.parametrize("bad", [-1, TOY_VOCAB, 2**63, 10**40])
def test_detokenize_names_the_bad_index_and_the_vocabulary(server, bad):
    url, _ = server
    reply = httpx.post(f"{url}/detokenize", json={"tokens": [72, 105, 33, bad, 5]})
    message = error_of(reply, "tokens.3")
    assert message.startswith("tokens.3: ") and f"[0, {TOY_VOCAB - 1}]" in message, message
    assert len(message) < 120
    assert httpx.post(f"{url}/detokenize", json={"tokens": [72, 105]}).status_code == 200


@pytest.mark.parametrize("path", [*BASES, "/tokenize", "/detokenize"])
@pytest.mark.parametrize(
    "body, kind",
    [
        pytest.param([1, 2], "an array", id="array"),
        pytest.param([], "an array", id="empty-array"),
        # the body's shape comes before its text
        pytest.param(["\ud800"], "an array", id="array-of-bad-text"),
        pytest.param(3, "a number", id="number"),
        pytest.param("x", "a string", id="string"),
        pytest.param(True, "a boolean", id="boolean"),
        pytest.param(None, "null", id="null"),
    ],
)
def test_a_body_that_is_not_an_object_is_told_so(server, path, body, kind):
    url, _ = server
    raw = json.dumps(body).encode()
    reply = httpx.post(f"{url}{path}", content=raw, headers={"content-type": "application/json"})
    assert error_of(reply, None) == f"request body must be a JSON object, got {kind}"


def test_a_member_that_is_not_an_object_is_named(server):
    url, _ = server
    body = {**BASES["/v1/chat/completions"], "messages": [1]}
    reply = httpx.post(f"{url}/v1/chat/completions", json=body)
    assert error_of(reply, "messages.0") == "messages.0: must be a JSON object"


@pytest.mark.parametrize(
    "path, field, value, low",
    [
        ("/v1/completions", "max_tokens", -1, 0),  # 0 with echo: the prompt alone
        ("/v1/completions", "max_tokens", 1.5, 0),
        ("/v1/chat/completions", "max_tokens", 0, 1),
        ("/v1/chat/completions", "max_tokens", "2", 1),
        ("/v1/chat/completions", "max_completion_tokens", 0, 1),
    ],
)
def test_max_tokens_gives_the_context_as_its_range(server, path, field, value, low):
    url, _ = server
    reply = httpx.post(f"{url}{path}", json={**BASES[path], field: value})
    message = error_of(reply, field)
    assert f"[{low}, {TOY_CONTEXT} - prompt tokens]" in message and "inf" not in message


@pytest.mark.parametrize("path", BASES)
@pytest.mark.parametrize("value", [-1, 1.5, "2"])
def test_min_tokens_gives_max_tokens_as_its_range(server, path, value):
    url, _ = server
    reply = httpx.post(f"{url}{path}", json={**BASES[path], "min_tokens": value})
    message = error_of(reply, "min_tokens")
    assert "[0, max_tokens]" in message and "inf" not in message


def test_max_tokens_past_the_context_is_refused_with_the_room_the_prompt_leaves(server):
    """prompt + max_tokens beyond max_model_len is a 400, as in vLLM (nothing is clamped);
    the message gives this prompt's range, whose top is accepted (checked, not run)."""
    url, state = server
    prompt = list(range(3, 13))
    room = TOY_CONTEXT - len(prompt)
    body = {"model": "toy", "prompt": prompt, "max_tokens": room + 1}
    message = error_of(httpx.post(f"{url}/v1/completions", json=body), "max_tokens")
    assert message.endswith(f"max_tokens must be in [1, {room}]"), message
    job = state.ready().jobs.completion_job(CompletionRequest(**{**body, "max_tokens": room}))
    assert job.params.max_tokens == room
    with pytest.raises(APIError):
        state.ready().jobs.completion_job(CompletionRequest(**body))


def test_context_and_token_ranges_before_the_model_has_loaded_are_named_in_words():
    cases = [
        (ChatCompletionRequest, {**BASES["/v1/chat/completions"], "max_tokens": 0}),
        (CompletionRequest, {**BASES["/v1/completions"], "min_tokens": -1}),
        (DetokenizeRequest, {"tokens": [1, None]}),
    ]
    found = []
    for model, body in cases:
        with pytest.raises(ValidationError) as raised:
            model.model_validate(body)
        found.append(describe_validation_error(raised.value.errors(), model))
    assert found == [
        ("max_tokens: must be in [1, max_model_len - prompt tokens], got 0", "max_tokens"),
        ("min_tokens: must be in [0, max_tokens], got -1", "min_tokens"),
        ("tokens.1: must be an integer (allowed: [0, vocab_size - 1])", "tokens.1"),
    ]


@pytest.mark.parametrize(
    "path, change, param",
    [
        ("/v1/completions", {"prompt": [1, 2, TOY_VOCAB]}, "prompt.2"),
        ("/v1/completions", {"prompt": [[1, 2], [3, 4, 5, 6, 7, -1]]}, "prompt.1.5"),
        ("/v1/completions", {"prompt": [[1], [10**40]]}, "prompt.1.0"),
        ("/v1/completions", {"stop_token_ids": [1, 2, -1]}, "stop_token_ids.2"),
        ("/v1/chat/completions", {"stop_token_ids": [TOY_VOCAB]}, "stop_token_ids.0"),
        ("/v1/completions", {"allowed_token_ids": [5, 2**63]}, "allowed_token_ids.1"),
        ("/v1/chat/completions", {"allowed_token_ids": [5, -3]}, "allowed_token_ids.1"),
        ("/v1/completions", {"logit_bias": {"1": 1.0, "259": 2.0}}, "logit_bias.259"),
        ("/v1/chat/completions", {"logit_bias": {"-3": 1.0}}, "logit_bias.-3"),
        ("/v1/completions", {"logit_bias": {"012": 1.0}}, "logit_bias.012"),
    ],
    ids=repr,
)
def test_a_bad_token_id_is_named_by_its_path(server, path, change, param):
    url, _ = server
    reply = httpx.post(f"{url}{path}", json={**BASES[path], **change})
    message = error_of(reply, param)
    assert message.startswith(f"{param}: must be a token id in [0, {TOY_VOCAB - 1}]"), message
    assert len(message) < 120
    # the key's spelling is named only where it is what is wrong
    misspelt = param in ("logit_bias.-3", "logit_bias.012")
    assert ("decimal digits" in message) == misspelt, message


@pytest.mark.parametrize("bad", ["5", True, None, [7]])
def test_a_logit_bias_value_that_is_no_number_gives_the_range(server, bad):
    url, _ = server
    body = {**BASES["/v1/completions"], "logit_bias": {"5": bad}}
    message = error_of(httpx.post(f"{url}/v1/completions", json=body), "logit_bias.5")
    assert message == "logit_bias.5: must be a number (allowed: [-100.0, 100.0])"


@pytest.mark.parametrize("bad", [1.5, "7", True, None, [7]])
def test_a_detokenize_entry_that_is_no_integer_gives_the_range(server, bad):
    url, _ = server
    reply = httpx.post(f"{url}/detokenize", json={"tokens": [72, bad]})
    message = error_of(reply, "tokens.1")
    assert message == f"tokens.1: must be an integer (allowed: [0, {TOY_VOCAB - 1}])"


@pytest.mark.parametrize(
    "prompt, param, want",
    [
        ([[1, 2], [3, 1.5]], "prompt.1.1", f"a token id in [0, {TOY_VOCAB - 1}], got 1.5"),
        ([5, True], "prompt.1", f"a token id in [0, {TOY_VOCAB - 1}], got true"),
        ([5, "a"], "prompt.1", f'a token id in [0, {TOY_VOCAB - 1}], got "a"'),
        ([[5], "a"], "prompt.1", f'a list of token ids in [0, {TOY_VOCAB - 1}], got "a"'),
        ([["a"]], "prompt.0.0", f'a token id in [0, {TOY_VOCAB - 1}], got "a"'),
        (["a", 5], "prompt.1", "a string, got 5"),
        ([None], "prompt.0", f"a token id in [0, {TOY_VOCAB - 1}], a list of them or a string"),
    ],
    ids=repr,
)
def test_a_prompt_entry_of_no_form_is_named_by_its_path(server, prompt, param, want):
    """The prompt's first entry says which form was meant; the first entry that breaks it
    is named, with what it must be and the forms a prompt may take (text among them)."""
    url, _ = server
    body = {**BASES["/v1/completions"], "prompt": prompt}
    message = error_of(httpx.post(f"{url}/v1/completions", json=body), param)
    assert message.startswith(f"{param}: must be {want}"), message
    assert message.endswith(
        "a prompt is text, a list of texts, token ids or a list of token-id lists"
    )


def test_a_prompt_entry_before_the_model_has_loaded_names_the_vocabulary_in_words():
    with pytest.raises(ValidationError) as raised:
        CompletionRequest.model_validate({**BASES["/v1/completions"], "prompt": [[1], [2, 0.5]]})
    message, param = describe_validation_error(raised.value.errors(), CompletionRequest)
    assert param == "prompt.1.1"
    assert message.startswith("prompt.1.1: must be a token id in [0, vocab_size - 1], got 0.5")


@pytest.mark.parametrize(
    "path, field",
    [
        ("/v1/completions", "max_tokens"),
        ("/v1/chat/completions", "max_tokens"),
        ("/v1/chat/completions", "max_completion_tokens"),
        ("/v1/completions", "top_k"),
        ("/v1/chat/completions", "max_loops"),
    ],
)
def test_a_huge_integer_is_shortened_in_the_message(server, path, field):
    """max_tokens past the context (the engine's check) or a bounded field (the schema's)."""
    url, _ = server
    reply = httpx.post(f"{url}{path}", json={**BASES[path], field: 10**30})
    message = error_of(reply, field)
    assert "10000000000000000000..." in message and str(10**30) not in message, message


@pytest.mark.parametrize("path", BASES)
@pytest.mark.parametrize(
    "stop, param, got",
    [([1], "stop.0", "1"), (["a", None], "stop.1", "null"), (["a", ["b"]], "stop.1", "an array")],
)
def test_a_stop_entry_that_is_no_string_is_named_by_its_path(server, path, stop, param, got):
    url, _ = server
    reply = httpx.post(f"{url}{path}", json={**BASES[path], "stop": stop})
    message = error_of(reply, param)
    assert (
        message == f"{param}: must be a string, got {got} (stop is a string or an array of strings)"
    )
