"""Hostile and careless request bodies: every bad value is a 4xx naming its field, refused
before anything is queued, and nothing one request sends stops the engine."""

from __future__ import annotations

import json
import threading

import httpx
import pytest

from tests.server.conftest import (
    BASES,
    ERROR_KEYS,
    assert_error,
    assert_healthy,
    running_server,
    wait_idle,
)

EXTREMES = [0, -1, 2**31, 2**63, 2**64, 1e308, float("nan")]


def numeric_fields(url: str) -> dict[str, list[str]]:
    """Every integer or number field (and list of them) of each POST body, from the schema."""
    schema = httpx.get(f"{url}/openapi.json").json()
    components = schema["components"]["schemas"]

    def numeric(spec: dict) -> bool:
        options = spec.get("anyOf", [spec])
        return any(
            o.get("type") in ("integer", "number")
            or o.get("items", {}).get("type") in ("integer", "number")
            for o in options
        )

    fields = {}
    for path, methods in schema["paths"].items():
        body = methods.get("post", {}).get("requestBody")
        if body:
            ref = body["content"]["application/json"]["schema"]["$ref"].rsplit("/", 1)[-1]
            properties = components[ref]["properties"]
            fields[path] = sorted(name for name, spec in properties.items() if numeric(spec))
    return fields


def test_extreme_top_k_is_a_400_and_the_engine_lives(server):
    url, state = server
    for top_k in (2**63, 10**30):
        body = {"model": "toy", "prompt": "347+589=", "max_tokens": 4, "top_k": top_k}
        error = assert_error(httpx.post(f"{url}/v1/completions", json=body), 400, "top_k")
        assert "2147483647" in error["message"]
    assert state.engine.dead is None
    assert_healthy(url)
    wait_idle(state)


def test_every_numeric_field_at_every_extreme_gives_4xx_or_runs(server):
    """0, -1, 2**31, 2**63, 2**64, 1e308 and NaN in every numeric field of every route."""
    url, state = server
    bases = {**BASES, "/tokenize": {"prompt": "x"}, "/detokenize": {"tokens": [65]}}
    fields = numeric_fields(url)
    assert "top_k" in fields["/v1/completions"] and "tokens" in fields["/detokenize"]
    with httpx.Client(base_url=url, timeout=60) as http:
        for path, names in fields.items():
            for name in names:
                for value in EXTREMES:
                    body = dict(bases[path])
                    is_list = name in ("prompt", "stop_token_ids", "tokens")
                    body[name] = [value] if is_list else value
                    # json.dumps writes NaN, as hostile clients do.
                    content = json.dumps(body).encode()
                    reply = http.post(
                        path, content=content, headers={"content-type": "application/json"}
                    )
                    assert reply.status_code < 500, (path, name, value, reply.text)
                    if reply.status_code >= 400:
                        assert set(reply.json()["error"]) == ERROR_KEYS
    assert state.engine.dead is None
    assert_healthy(url)
    wait_idle(state)


@pytest.mark.parametrize("path", list(BASES))
@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_tokens", "5"),
        ("max_tokens", True),
        ("temperature", "0.5"),
        ("temperature", False),
        ("n", 2.0),
        ("logit_bias", {"\u0661\u0662": 1}),  # Arabic-Indic "12"
        ("logit_bias", {"12": "1"}),
        ("logit_bias", {"12": True}),
        ("logit_bias", {"012": 1}),  # "12" and "012" would name one token twice
        ("logit_bias", {"9" * 5000: 1}),  # past Python's int() digit limit
        ("ignore_eos", "true"),
        ("stream", 1),
    ],
    ids=repr,
)
def test_fields_take_only_their_json_type(server, path, field, value):
    """OpenAI types these integer, number or boolean: a string, a boolean for a number, a
    float for an integer, a number for a flag or a key in other digits than 0-9 is refused,
    never converted."""
    url, _ = server
    reply = httpx.post(f"{url}{path}", json={**BASES[path], field: value})
    error = assert_error(reply, 400)
    assert error["param"].split(".")[0] == field and field in error["message"], error


@pytest.mark.parametrize("path", list(BASES))
def test_integers_are_numbers_and_digit_keys_are_token_ids(server, path):
    url, _ = server
    body = {**BASES[path], "temperature": 1, "logit_bias": {"12": 1}}
    assert httpx.post(f"{url}{path}", json=body, timeout=60).status_code == 200


def test_stop_strings_are_at_most_64(server):
    url, _ = server
    body = {**BASES["/v1/completions"], "stop": ["x"] * 65}
    error = assert_error(httpx.post(f"{url}/v1/completions", json=body), 400, "stop")
    assert "at most 64" in error["message"]
    body["stop"] = ["x"] * 64
    assert httpx.post(f"{url}/v1/completions", json=body, timeout=60).status_code == 200


def test_prompt_token_ids_out_of_range_are_400(server):
    url, _ = server
    for ids, expected in (([-1], "[0, 258]"), ([2**40], "[0, 258]"), ([2**64], "[0, 258]")):
        body = {"model": "toy", "prompt": ids, "max_tokens": 2, "echo": True}
        error = assert_error(httpx.post(f"{url}/v1/completions", json=body), 400, "prompt.0")
        assert expected in error["message"]
    body = {"model": "toy", "prompt": [5, True], "max_tokens": 2}
    error = assert_error(httpx.post(f"{url}/v1/completions", json=body), 400, "prompt.1")
    assert "[0, 258]" in error["message"]


def test_priority_is_bounded_and_needs_the_priority_policy(server):
    url, _ = server
    for value, says in ((2**31, "priority"), ("high", "priority"), (3, "--scheduling-policy")):
        body = {"model": "toy", "prompt": "x", "max_tokens": 2, "priority": value}
        error = assert_error(httpx.post(f"{url}/v1/completions", json=body), 400, "priority")
        assert says in error["message"]
    assert_healthy(url)


def test_lone_surrogates_are_400_naming_the_field(server):
    url, _ = server
    cases = [
        ("/v1/completions", {"model": "toy", "prompt": "ab\ud800"}, "prompt"),
        ("/v1/completions", {"model": "toy", "prompt": ["ok", "\udfff"]}, "prompt.1"),
        (
            "/v1/chat/completions",
            {"model": "toy", "messages": [{"role": "user", "content": "\ud800"}]},
            "messages.0.content",
        ),
        ("/tokenize", {"prompt": "\ud800"}, "prompt"),
        (  # a field name: no error message may hold it (it cannot be encoded)
            "/v1/chat/completions",
            {"model": "toy", "messages": [{"role": "user", "content": [{"\ud800": 1}]}]},
            "messages.0.content.0 (a field name)",
        ),
    ]
    for path, body, param in cases:
        content = json.dumps(body).encode()  # ASCII-escaped: "\ud800" on the wire
        reply = httpx.post(f"{url}{path}", content=content)
        error = assert_error(reply, 400, param)
        assert "lone surrogate" in error["message"]


def test_fan_out_is_bounded_before_anything_is_queued(server):
    url, state = server
    body = {"model": "toy", "prompt": ["1+1="] * 2000, "n": 128, "max_tokens": 1}
    error = assert_error(httpx.post(f"{url}/v1/completions", json=body), 400, "n")
    assert error["message"].startswith("n: prompts x n = 2000 x 128 = 256000 sequences")
    assert "--max-sequences-per-request" in error["message"]
    assert state.engine.engine_stats().num_requests == 0 and state.engine.num_requests == 0
    body = {"model": "toy", "prompt": "x", "n": 129}
    assert_error(httpx.post(f"{url}/v1/completions", json=body), 400, "n")


@pytest.mark.parametrize("path", sorted(BASES))
def test_constraints_that_leave_nothing_to_sample_are_400_before_queueing(
    server, monkeypatch, path
):
    """The only allowed token a bad word ("a" is token 100), a later step emptied by a
    longer one, or only EOS allowed before min_tokens: each a 400 naming the fields, with
    any n or filter, streamed or not, and nothing queued."""
    url, state = server
    queued: list[str] = []
    monkeypatch.setattr(state.engine, "add_request", lambda *args, **_: queued.append(args[0]))
    only_a = {"allowed_token_ids": [100], "bad_words": ["a"]}
    cases = [
        (only_a, "at the first token: of allowed_token_ids [100], bad_words bar [100]"),
        ({**only_a, "n": 8, "temperature": 1.0}, "bad_words bar [100]"),
        ({**only_a, "top_k": 3, "top_p": 0.5, "min_tokens": 2}, "bad_words bar [100]"),
        ({**only_a, "temperature": 0, "stream": True}, "bad_words bar [100]"),
        (
            {"allowed_token_ids": [100], "bad_words": ["aa"], "ignore_eos": True},
            "after 1 token, once the output ends with the tokens [100]",
        ),
        ({"allowed_token_ids": [0, 2], "min_tokens": 1}, "min_tokens (1) bans the EOS"),
    ]
    for fields, message in cases:
        reply = httpx.post(f"{url}{path}", json={**BASES[path], **fields})
        error = assert_error(reply, 400, "allowed_token_ids")
        assert message in error["message"] and "nothing could be sampled" in error["message"]
    assert queued == []


def test_max_sequences_per_request_is_configurable():
    with running_server(max_sequences_per_request=4) as (url, state):
        body = {"model": "toy", "prompt": ["a", "b"], "n": 2, "max_tokens": 1}
        assert httpx.post(f"{url}/v1/completions", json=body, timeout=60).status_code == 200
        body["n"] = 3
        assert_error(httpx.post(f"{url}/v1/completions", json=body), 400, "n")
        wait_idle(state)


def test_logprob_entries_per_reply_are_bounded(server):
    """The default bound refuses a reply of 2 x 128 choices x 4000 prompt tokens x 21 before it
    runs; a small one counts choices x tokens x (logprobs + 1) exactly, prompt_logprobs and
    echo included, and a stream is sent as it comes."""
    url, state = server
    huge = {"model": "toy", "prompt": [[5] * 4000, [6] * 4000], "max_tokens": 1, "n": 128}
    error = assert_error(
        httpx.post(f"{url}/v1/completions", json={**huge, "prompt_logprobs": 20}),
        400,
        "prompt_logprobs",
    )
    assert "21504000" in error["message"] and "--max-logprobs-per-request" in error["message"]
    wait_idle(state)
    with running_server(max_logprobs_per_request=60) as (small, state):
        body = {"model": "toy", "prompt": [5, 6, 7, 8], "max_tokens": 5, "n": 2}
        # 2 choices x 5 tokens x 3 = 30, then 2 x 4 prompt tokens x 3 more = 54
        for extra, status in (
            ({"logprobs": 2}, 200),
            ({"logprobs": 2, "prompt_logprobs": 2}, 200),
            ({"logprobs": 2, "prompt_logprobs": 3}, 400),  # 30 + 2 x 4 x 4 = 62
            ({"logprobs": 2, "echo": True}, 400),  # 2 x 9 x 3 + 2 x 4 x 3 = 78
            # the prompt alone: 2 x 5 x 3 echoed + 2 x 5 x 3 prompt_logprobs = 60, no token
            ({"prompt": [5, 6, 7, 8, 9], "max_tokens": 0, "logprobs": 2, "echo": True}, 200),
            ({"logprobs": 2, "n": 5, "stream": True}, 200),
        ):
            reply = httpx.post(f"{small}/v1/completions", json={**body, **extra}, timeout=60)
            assert reply.status_code == status, (extra, reply.text)
        chat = {"model": "toy", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 21}
        chat |= {"logprobs": True, "top_logprobs": 2}  # 21 x 3 = 63
        assert_error(httpx.post(f"{small}/v1/chat/completions", json=chat), 400, "top_logprobs")
        wait_idle(state)


@pytest.mark.parametrize(
    ("path", "change", "param"),
    [
        ("/v1/completions", {"prompt": []}, "prompt"),
        ("/v1/completions", {"stream_options": {"include_usage": True}}, "stream_options"),
        ("/v1/chat/completions", {"stream_options": {}, "stream": False}, "stream_options"),
        ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),
        ("/tokenize", {"messages": []}, "messages"),
        ("/tokenize", {"prompt": "x", "add_generation_prompt": False}, "add_generation_prompt"),
        ("/v1/chat/completions", {"continue_final_message": "yes"}, "continue_final_message"),
        ("/tokenize", {"prompt": "x", "messages": [{"role": "user", "content": "x"}]}, "prompt"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "x", "b": 1}]}]},
            "messages.0.content.0",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
            "messages.0.content.0.type",
        ),
        (
            "/v1/chat/completions",
            {
                "messages": [
                    {"role": "user", "content": "a"},
                    {"role": "user", "content": [{"type": "text", "text": 5}]},
                ]
            },
            "messages.1.content.0.text",
        ),
        (
            "/tokenize",
            {"messages": [{"role": "user", "content": [{"type": "x"}]}]},
            "messages.0.content.0.type",
        ),
        ("/v1/chat/completions", {"max_completion_tokens": 5000}, "max_completion_tokens"),
        ("/v1/chat/completions", {"max_tokens": 5000}, "max_tokens"),
    ],
    ids=repr,
)
def test_checks_across_fields_name_the_field(server, path, change, param):
    """Refused with a 400 naming the field (vLLM refuses stream_options without a stream;
    a content part has only a type and a text, and is named by its path)."""
    url, _ = server
    body = {**BASES.get(path, {"model": "toy"}), **change}
    error = assert_error(httpx.post(f"{url}{path}", json=body), 400, param)
    if param.startswith("messages."):  # a content part's field, by its path
        assert error["message"].startswith(f"{param}: ")
    elif param.startswith("max_"):  # beyond the context: named as the client named it
        assert f"{param} (5000)" in error["message"]


def test_a_long_prompt_is_tokenized_with_the_gil_released(server, monkeypatch):
    """A prompt past GIL_FREE_CHARS, to /tokenize or a completion, is encoded with the GIL
    released (on build_job's worker thread the event loop keeps serving other clients),
    and gives the ids a short-path encode gives."""
    from vllm_rlt.tokenizer import Tokenizer
    from vllm_rlt.tokenizer.tokenizer import GIL_FREE_CHARS

    url, _ = server
    long = "1+1=" * (GIL_FREE_CHARS // 4 + 1)
    want = Tokenizer.byte_level().encode(long)
    flags: list[bool] = []
    encode = Tokenizer.encode

    def spied(self, text, add_special_tokens=True, release_gil=False):
        flags.append(release_gil)
        return encode(self, text, add_special_tokens, release_gil)

    monkeypatch.setattr(Tokenizer, "encode", spied)
    reply = httpx.post(f"{url}/tokenize", json={"prompt": long})
    assert reply.status_code == 200
    assert reply.json()["tokens"] == want
    body = {"model": "toy", "prompt": long}
    error = assert_error(httpx.post(f"{url}/v1/completions", json=body), 400)
    assert "exceeds the context length" in error["message"]
    httpx.post(f"{url}/tokenize", json={"prompt": "1+1="})
    assert flags == [True, True, False]


def test_concurrent_bad_and_good_requests(server):
    """A burst of hostile requests beside normal ones: the normal ones all finish."""
    url, state = server
    hostile = [
        {"model": "toy", "prompt": "x", "top_k": 2**64},
        {"model": "toy", "prompt": [2**64]},
        {"model": "toy", "prompt": "\ud800"},
        {"model": "toy", "prompt": "x", "seed": -(2**63) - 1},
        {"model": "toy", "prompt": ["x"] * 300},
    ]
    good = {"model": "toy", "prompt": "fine", "max_tokens": 4, "ignore_eos": True}
    results: list[int] = []

    def send(body) -> None:
        content = json.dumps(body).encode()
        results.append(httpx.post(f"{url}/v1/completions", content=content, timeout=60).status_code)

    threads = [threading.Thread(target=send, args=(b,)) for b in hostile * 3 + [good] * 6]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(results) == [200] * 6 + [400] * 15
    wait_idle(state)
