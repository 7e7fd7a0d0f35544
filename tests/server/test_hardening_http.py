"""Hostile and careless HTTP: the API key in any spelling, browser origins, bodies and heads
over their limits, slow or idle connections, and error bodies that keep the OpenAI shape
even for requests too broken to reach a route."""

from __future__ import annotations

import json
import socket

import httpx

from tests.server.conftest import (
    ERROR_KEYS,
    assert_error,
    assert_healthy,
    running_server,
    wait_idle,
    wait_until,
)


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
