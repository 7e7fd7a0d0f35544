"""Bad request bodies get 400s that name the field and its true range: the loop fields are
bounded by the served model's depth, a bad token id is named by its index, and a body that
is not a JSON object is told so."""

from __future__ import annotations

import json

import httpx
import pytest
from pydantic import ValidationError

from vllm_rlt.entrypoints.openai.protocol import CompletionRequest, describe_validation_error

BODIES = {
    "/v1/completions": {"model": "toy", "prompt": "x", "max_tokens": 2},
    "/v1/chat/completions": {
        "model": "toy",
        "messages": [{"role": "user", "content": "x"}],
        "max_tokens": 2,
    },
}
TOY_DEPTH = 4
TOY_VOCAB = 259


def error_of(reply: httpx.Response, param: str | None) -> str:
    """The message of an OpenAI-style 400 whose param is `param`."""
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["code"] == 400 and error["type"] == "invalid_request_error"
    assert error["param"] == param, error
    return error["message"]


@pytest.mark.parametrize("path", BODIES)
@pytest.mark.parametrize("field", ["min_loops", "max_loops"])
@pytest.mark.parametrize("value", [1.5, 2.0, -1, 0, TOY_DEPTH + 1, 2**63, "2", True])
def test_loop_fields_give_the_models_depth_as_their_range(server, path, field, value):
    url, _ = server
    reply = httpx.post(f"{url}{path}", json={**BODIES[path], field: value})
    message = error_of(reply, field)
    assert message.startswith(field) and f"[1, {TOY_DEPTH}]" in message, message
    assert "inf" not in message


def test_loop_fields_within_the_depth_run(server):
    url, _ = server
    body = {**BODIES["/v1/completions"], "min_loops": 2, "max_loops": TOY_DEPTH}
    assert httpx.post(f"{url}/v1/completions", json=body).status_code == 200


def test_exit_threshold_keeps_its_finite_range(server):
    url, _ = server
    for value in (1.5, -1, "0.5"):
        body = {**BODIES["/v1/completions"], "exit_threshold": value}
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


@pytest.mark.parametrize("path", [*BODIES, "/tokenize", "/detokenize"])
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
    body = {**BODIES["/v1/chat/completions"], "messages": [1]}
    reply = httpx.post(f"{url}/v1/chat/completions", json=body)
    assert error_of(reply, "messages.0") == "messages.0: must be a JSON object"
