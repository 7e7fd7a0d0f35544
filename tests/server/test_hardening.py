"""Hostile and careless input: every bad value is a 4xx naming its field, nothing one request
does stops the engine, a client that leaves frees its place at once, and error bodies keep
the OpenAI shape even for requests too broken to reach a route."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import threading
import time

import httpx
import pytest

from tests.server.conftest import core_engine, running_server, wait_idle
from vllm_rlt.engine.engine_args import EngineArgs
from vllm_rlt.engine.output_processor import RequestState

EXTREMES = [0, -1, 2**31, 2**63, 2**64, 1e308, float("nan")]
ERROR_KEYS = {"message", "type", "param", "code"}
BASES = {
    "/v1/completions": {"model": "toy", "prompt": "x", "max_tokens": 2},
    "/v1/chat/completions": {
        "model": "toy",
        "messages": [{"role": "user", "content": "x"}],
        "max_tokens": 2,
    },
}


def assert_error(reply: httpx.Response, status: int, param: str | None = None) -> dict:
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert set(error) == ERROR_KEYS and error["code"] == status
    if param is not None:
        assert error["param"] == param, error
    return error


def assert_healthy(url: str) -> None:
    assert httpx.get(f"{url}/health").status_code == 200
    body = {"model": "toy", "prompt": "still fine", "max_tokens": 3, "ignore_eos": True}
    reply = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert reply.status_code == 200 and reply.json()["choices"][0]["finish_reason"] == "length"


def wait_until(condition, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)


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
    assert (
        "wrong type" in assert_error(httpx.post(f"{url}/v1/completions", json=body), 400)["message"]
    )


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


def test_the_api_key_check_takes_any_scheme_case_and_any_header_bytes():
    """The Bearer scheme in any case (RFC 9110); a header that is not UTF-8 is harmless; a
    repeated Authorization header passes only if every copy carries the key."""
    with running_server(api_key="sekrit") as (url, state):
        body = {"model": "toy", "prompt": "x", "max_tokens": 2}
        for auth in (b"Bearer sekrit", b"bearer sekrit", b"BEARER  sekrit"):
            headers = {"authorization": auth, "x-junk": b"\xff\xfe"}
            reply = httpx.post(f"{url}/v1/completions", json=body, headers=headers)
            assert reply.status_code == 200, auth
        for auth in (b"Bearer \xff", b"Basic sekrit", b"Bearersekrit", b"sekrit", b"Bearer sekri"):
            reply = httpx.post(f"{url}/v1/completions", json=body, headers={"authorization": auth})
            assert_error(reply, 401)
        assert_error(httpx.post(f"{url}/v1/completions", json=body), 401)
        # a repeated header: every copy must carry the key, whichever comes last
        for pair in ((b"Bearer sekrit", b"Bearer wrong"), (b"Bearer wrong", b"Bearer sekrit")):
            headers = [(b"authorization", auth) for auth in pair]
            reply = httpx.post(f"{url}/v1/completions", json=body, headers=headers)
            assert_error(reply, 401)
        headers = [(b"authorization", b"Bearer sekrit")] * 2
        reply = httpx.post(f"{url}/v1/completions", json=body, headers=headers)
        assert reply.status_code == 200
        wait_idle(state)


def test_fan_out_is_bounded_before_anything_is_queued(server):
    url, state = server
    body = {"model": "toy", "prompt": ["1+1="] * 2000, "n": 128, "max_tokens": 1}
    error = assert_error(httpx.post(f"{url}/v1/completions", json=body), 400, "n")
    assert "256000" in error["message"] and "--max-sequences-per-request" in error["message"]
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


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "plain"])
def test_client_leaving_while_queued_frees_its_place_at_once(stream):
    """One slot, held by a long request; a second request waits behind it. Its client
    leaves: the waiting request is gone from the engine while the first still runs."""
    with running_server(max_num_seqs=1, in_process=True) as (url, state):
        engine = core_engine(state)
        holder = {"model": "toy", "prompt": "hold", "max_tokens": 3000, "ignore_eos": True}
        waiter = {"model": "toy", "prompt": "wait", "max_tokens": 5, "stream": stream}
        with httpx.stream("POST", f"{url}/v1/completions", json={**holder, "stream": True}) as r:
            lines = r.iter_lines()  # kept: dropping the iterator would close the stream
            next(lines)  # the holder runs
            holder_id = next(iter(engine.groups))

            async def leave() -> None:
                async with httpx.AsyncClient(timeout=60) as http:
                    post = asyncio.ensure_future(http.post(f"{url}/v1/completions", json=waiter))
                    await asyncio.to_thread(wait_until, lambda: len(engine.groups) == 2)
                    post.cancel()  # closes the connection
                    with pytest.raises(asyncio.CancelledError):
                        await post

            asyncio.run(leave())
            wait_until(lambda: len(engine.groups) == 1 and not engine.scheduler.waiting)
            assert holder_id in engine.groups  # the holder was still running
        wait_idle(state)


def test_failure_of_one_requests_state_fails_it_alone(monkeypatch):
    """An error while writing one request's slot (in the core), and one while turning its
    tokens into output (in the frontend), fail that request with a 500; a request beside it
    finishes and no block leaks."""
    with running_server(in_process=True) as (url, state):
        _fail_one_request_state(url, state, monkeypatch)


def _fail_one_request_state(url, state, monkeypatch):
    engine = core_engine(state)
    admit = engine.runner.state.admit_extras
    absorb = RequestState._absorb_completion

    def failing_admit(new):
        if new.sampling.seed == 4242:
            raise OverflowError("simulated slot write failure")
        admit(new)

    def failing_absorb(self, part):
        if self.params.seed == 4343:
            raise RuntimeError("simulated output failure")
        return absorb(self, part)

    monkeypatch.setattr(engine.runner.state, "admit_extras", failing_admit)
    monkeypatch.setattr(RequestState, "_absorb_completion", failing_absorb)
    base = {"model": "toy", "prompt": "x", "max_tokens": 6, "ignore_eos": True}

    async def fire() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:
            return await asyncio.gather(
                http.post("/v1/completions", json={**base, "seed": 4242}),
                http.post("/v1/completions", json={**base, "seed": 4343, "n": 2}),
                http.post("/v1/completions", json={**base, "seed": 1}),
            )

    slot_failed, output_failed, fine = asyncio.run(fire())
    assert "simulated slot write failure" in assert_error(slot_failed, 500)["message"]
    assert "simulated output failure" in assert_error(output_failed, 500)["message"]
    assert fine.status_code == 200 and fine.json()["choices"][0]["finish_reason"] == "length"
    assert state.engine.dead is None
    wait_idle(state)
    assert_healthy(url)


def test_an_engine_death_is_logged_with_its_traceback(caplog):
    with running_server(in_process=True) as (url, state):
        engine = core_engine(state)

        def broken_step():
            raise RuntimeError("simulated device fault")

        engine.step = broken_step
        with caplog.at_level(logging.ERROR):
            body = {"model": "toy", "prompt": "x", "max_tokens": 2}
            assert_error(httpx.post(f"{url}/v1/completions", json=body, timeout=60), 503)
        assert httpx.get(f"{url}/health").status_code == 503
        records = [r.getMessage() for r in caplog.records if "engine stopped" in r.getMessage()]
        assert records and "Traceback" in records[0] and "simulated device fault" in records[0]


def test_queue_bound_counts_only_requests_beyond_free_slots():
    with running_server(max_num_seqs=8, max_queue=2) as (url, state):
        body = {"model": "toy", "prompt": "q", "max_tokens": 2, "ignore_eos": True}

        async def burst(count: int) -> list[int]:
            async with httpx.AsyncClient(timeout=60) as http:
                replies = await asyncio.gather(
                    *(http.post(f"{url}/v1/completions", json=body) for _ in range(count))
                )
            return [r.status_code for r in replies]

        assert asyncio.run(burst(10)) == [200] * 10  # 8 run, 2 wait: none is refused
        never = {**body, "prompt": ["a"] * 11}
        error = assert_error(httpx.post(f"{url}/v1/completions", json=never), 400, "n")
        assert "--max-queue" in error["message"] and "11" in error["message"]
        wait_idle(state)


def test_error_bodies_keep_the_openai_shape(server):
    url, _ = server
    assert "GET /nope" in assert_error(httpx.get(f"{url}/nope"), 404)["message"]
    assert_error(httpx.get(f"{url}/v1/completions"), 405)
    deep = ("[" * 1000 + "]" * 1000).encode()
    assert_error(httpx.post(f"{url}/v1/completions", content=deep), 400)
    not_utf8 = b'{"model": "toy", "prompt": "\xff"}'
    assert (
        "UTF-8"
        in assert_error(httpx.post(f"{url}/v1/completions", content=not_utf8), 400)["message"]
    )
    error = assert_error(
        httpx.post(f"{url}/v1/completions", json={"model": "toy", "prompt": "x", "max_loops": 9}),
        400,
        "max_loops",
    )
    assert "[1, 4]" in error["message"]


def test_odd_bodies_and_paths_get_errors_that_say_what_is_wrong(server):
    url, _ = server
    for path in ("/v1/completions", "/v1/chat/completions", "/tokenize"):
        error = assert_error(httpx.post(f"{url}{path}", content=b""), 400)
        assert error["message"] == "request body is missing: send a JSON object"
    digits = b'{"model": "toy", "prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}"
    error = assert_error(httpx.post(f"{url}/v1/completions", content=digits), 400)
    assert "more than 4300 digits" in error["message"]
    error = assert_error(httpx.post(f"{url}/v1/completions/", json={"model": "toy"}), 404)
    assert error["message"] == "no route POST /v1/completions/"
    body = {"model": "toy", "prompt": "x", "max_tokens": 2}
    for kind in ("application/jsonx", "text/plain; charset=\xff"):
        headers = {"content-type": kind.encode("latin-1")}
        reply = httpx.post(f"{url}/v1/completions", json=body, headers=headers)
        assert reply.status_code == 200, (kind, reply.text)
    assert_healthy(url)


def test_a_body_without_json_content_type_is_read_as_json(server):
    """`curl -d` sends application/x-www-form-urlencoded."""
    url, _ = server
    body = b'{"model": "toy", "prompt": "x", "max_tokens": 2}'
    for content_type in ("application/x-www-form-urlencoded", None):
        headers = {"content-type": content_type} if content_type else {}
        reply = httpx.post(f"{url}/v1/completions", content=body, headers=headers)
        assert reply.status_code == 200, reply.text


def test_a_browser_origin_not_listed_is_refused(server):
    """A page on another site could make a browser POST here without asking first; such a
    request carries an Origin header, which --allowed-origins (none by default) must list."""
    url, _ = server
    body = {"model": "toy", "prompt": "x", "max_tokens": 2}
    for path, method in (("/v1/completions", "POST"), ("/health", "GET"), ("/pause", "POST")):
        headers = {"origin": "https://evil.example", "content-type": "text/plain"}
        reply = httpx.request(method, f"{url}{path}", json=body, headers=headers)
        error = assert_error(reply, 403)
        assert error["param"] == "origin" and "--allowed-origins" in error["message"]
    assert httpx.post(f"{url}/v1/completions", json=body).status_code == 200  # no Origin


def test_listed_origins_get_cors_replies_even_with_an_api_key():
    origin = "https://app.example"
    with running_server(allowed_origins=(origin,), api_key="k") as (url, _):
        preflight = {"origin": origin, "access-control-request-method": "POST"}
        preflight["access-control-request-headers"] = "authorization, content-type"
        reply = httpx.options(f"{url}/v1/completions", headers=preflight)
        assert reply.status_code == 200, reply.text
        assert reply.headers["access-control-allow-origin"] == origin
        headers = {"origin": origin, "authorization": "Bearer k"}
        body = {"model": "toy", "prompt": "x", "max_tokens": 2}
        reply = httpx.post(f"{url}/v1/completions", json=body, headers=headers)
        assert reply.status_code == 200 and reply.headers["access-control-allow-origin"] == origin
        other = {"origin": "https://other.example", "authorization": "Bearer k"}
        assert_error(httpx.post(f"{url}/v1/completions", json=body, headers=other), 403)


def test_chunked_body_over_the_limit_is_413():
    with running_server(max_body_bytes=200) as (url, _):

        def chunks():
            yield b'{"model": "toy", "prompt": "'
            for _ in range(10):
                yield b"x" * 100
            yield b'"}'

        reply = httpx.post(f"{url}/v1/completions", content=chunks())
        assert_error(reply, 413)


def raw_exchange(url: str, data: bytes, wait: float = 30.0) -> bytes:
    """Send raw bytes; everything the server answers until it closes the connection."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=wait) as sock:
        sock.sendall(data)
        received = b""
        while chunk := sock.recv(65536):
            received += chunk
        return received


def test_malformed_content_length_gets_a_json_400(server):
    url, _ = server
    reply = raw_exchange(
        url,
        b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b"content-length: abc\r\n\r\n{}",
    )
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400") and b"application/json" in head
    assert set(json.loads(body)["error"]) == ERROR_KEYS


def test_a_request_head_over_the_limit_is_400_even_when_it_comes_in_one_read(server):
    """The head is counted before it is parsed (a whole head in one read used to pass
    uncounted); the body after a small head, in the same read, is not head."""
    url, _ = server
    head = b"GET /health HTTP/1.1\r\nhost: x\r\nx-big: " + b"a" * 20_000 + b"\r\n\r\n"
    reply = raw_exchange(url, head)
    assert reply.startswith(b"HTTP/1.1 400") and b"request head over 16384 bytes" in reply
    body = json.dumps({"prompt": "x" * 30_000}).encode()
    request = (
        b"POST /tokenize HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b"connection: close\r\ncontent-length: " + str(len(body)).encode() + b"\r\n\r\n"
    )
    assert raw_exchange(url, request + body).startswith(b"HTTP/1.1 200")


def _closed(sock: socket.socket) -> bool:
    """Whether the server has closed this client socket (nothing read is lost: a peek)."""
    sock.setblocking(False)
    try:
        return sock.recv(1, socket.MSG_PEEK) == b""
    except BlockingIOError:
        return False


def test_idle_and_slow_connections_are_closed():
    """A connection that never completes its request head is closed after the header
    timeout; beyond the limit a new connection takes the place of the one idle longest,
    and where every connection is in a request it gets a 503 error object."""
    with running_server(header_timeout=0.5, max_connections=4) as (url, _):
        assert raw_exchange(url, b"") == b""  # idle: closed without a reply
        assert raw_exchange(url, b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n") == b""
    with running_server(header_timeout=30, body_timeout=30, max_connections=2) as (url, _):
        host, port = url.removeprefix("http://").split(":")
        idle = [socket.create_connection((host, int(port))) for _ in range(2)]
        try:
            idle[1].sendall(b"GET /health HTTP/1.1\r\n")  # half a head: idle too
            reply = raw_exchange(url, b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
            assert reply.startswith(b"HTTP/1.1 200"), reply
            wait_until(lambda: any(map(_closed, idle)))  # one made room for it
            assert not all(map(_closed, idle))
        finally:
            for sock in idle:
                sock.close()
        busy: list[socket.socket] = []
        try:
            for _ in range(2):  # each in a request (the server asks for its body) in turn
                sock = socket.create_connection((host, int(port)))
                busy.append(sock)
                sock.sendall(
                    b"POST /v1/completions HTTP/1.1\r\nhost: x\r\nexpect: 100-continue\r\n"
                    b"content-type: application/json\r\ncontent-length: 100\r\n\r\n"
                )
                sock.settimeout(10)
                assert sock.recv(64).startswith(b"HTTP/1.1 100")
            reply = raw_exchange(url, b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
            head, _, body = reply.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 503")
            assert json.loads(body)["error"]["type"] == "service_unavailable"
        finally:
            for sock in busy:
                sock.close()
        wait_until(lambda: httpx.get(f"{url}/health").status_code == 200)


def test_slow_body_is_408():
    with running_server(body_timeout=0.5) as (url, _):
        reply = raw_exchange(
            url,
            b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"content-length: 100\r\n\r\n{",
        )
        head, _, body = reply.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408")
        assert json.loads(body)["error"]["code"] == 408


def test_include_stop_str_in_output(server):
    url, _ = server
    base = {"model": "toy", "prompt": "The quick brown fox", "max_tokens": 16, "temperature": 0}
    base["ignore_eos"] = True
    text = httpx.post(f"{url}/v1/completions", json=base).json()["choices"][0]["text"]
    stop = next(text[i : i + 2] for i in range(2, len(text) - 2) if text[i : i + 2].isprintable())
    cut = text[: text.find(stop)]
    for include, expected in ((False, cut), (True, cut + stop)):
        body = {**base, "stop": [stop], "include_stop_str_in_output": include}
        choice = httpx.post(f"{url}/v1/completions", json=body).json()["choices"][0]
        assert choice["text"] == expected and choice["finish_reason"] == "stop"
        streamed = ""
        with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    streamed += "".join(c["text"] for c in json.loads(line[6:])["choices"])
        assert streamed == expected


def test_concurrent_bad_and_good_requests(server):
    """A burst of hostile requests beside normal ones: the normal ones all finish."""
    url, state = server
    hostile = [
        {"model": "toy", "prompt": "x", "top_k": 2**64},
        {"model": "toy", "prompt": [2**64]},
        {"model": "toy", "prompt": "\ud800"},
        {"model": "toy", "prompt": "x", "seed": -1},
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


def test_the_frontend_knows_the_cores_eos_ids_without_a_tokenizer():
    """With skip_tokenizer_init the frontend has no tokenizer, yet a request that allows only
    EOS while min_tokens bans it is refused before it is queued: the core's EOS ids come in
    its handshake."""
    from vllm_rlt import SamplingParams
    from vllm_rlt.config import ParamError
    from vllm_rlt.engine.async_llm import AsyncLLM

    engine = AsyncLLM.from_engine_args(EngineArgs(skip_tokenizer_init=True), in_process=True)
    try:
        assert engine.tokenizer is None and engine.info.eos_token_ids
        eos = engine.info.eos_token_ids[0]
        params = SamplingParams(allowed_token_ids=[eos], min_tokens=1, max_tokens=4)
        with pytest.raises(ParamError, match="min_tokens"):
            engine.check_request("r", [40, 41], params)
        engine.check_request("r", [40, 41], SamplingParams(allowed_token_ids=[eos]))
        with pytest.raises(ParamError, match="no tokenizer"):
            asyncio.run(engine.get_tokenizer())
    finally:
        engine.shutdown()


def test_async_llm_gives_the_tokenizer_llm_gives():
    """vLLM's `await engine.get_tokenizer()`, the same object type as LLM.get_tokenizer."""
    from vllm_rlt.engine.async_llm import AsyncLLM

    engine = AsyncLLM.from_engine_args(EngineArgs(), in_process=True)
    try:
        tokenizer = asyncio.run(engine.get_tokenizer())
        assert tokenizer.eos_token_id in engine.info.eos_token_ids
        assert tokenizer("347+589=")["input_ids"] == engine.tokenizer.encode("347+589=")
        assert asyncio.run(engine.get_tokenizer()) is tokenizer
    finally:
        engine.shutdown()


@pytest.mark.parametrize(
    ("path", "change", "param"),
    [
        ("/v1/completions", {"prompt": []}, "prompt"),
        ("/v1/completions", {"stream_options": {"include_usage": True}}, "stream_options"),
        ("/v1/chat/completions", {"stream_options": {}, "stream": False}, "stream_options"),
        ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),
        ("/tokenize", {"messages": []}, "messages"),
        ("/tokenize", {"prompt": "x", "messages": [{"role": "user", "content": "x"}]}, "prompt"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "x", "b": 1}]}]},
            None,
        ),
        ("/v1/chat/completions", {"max_completion_tokens": 5000}, "max_completion_tokens"),
        ("/v1/chat/completions", {"max_tokens": 5000}, "max_tokens"),
    ],
    ids=repr,
)
def test_checks_across_fields_name_the_field(server, path, change, param):
    """Refused with a 400 naming the field (vLLM refuses stream_options without a stream;
    a content part has only a type and a text)."""
    url, _ = server
    body = {**BASES.get(path, {"model": "toy"}), **change}
    error = assert_error(httpx.post(f"{url}{path}", json=body), 400, param)
    if param is None:
        assert "unknown field" in error["message"] and "b" in error["message"]
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
