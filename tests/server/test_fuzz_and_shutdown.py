"""Random request bodies never cause a 5xx; SIGTERM lets in-flight requests finish."""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.server.conftest import (
    core_pid,
    process_exists,
    serve_process,
    wait_idle,
)

SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.sampled_from([-1, 0, 1, 2, 3, 21, 129, 10**9]),
    st.floats(allow_nan=False, allow_infinity=False, min_value=-5, max_value=5),
    st.text(max_size=12),
)
VALUES = st.one_of(
    SCALARS,
    st.lists(SCALARS, max_size=3),
    st.dictionaries(st.text(max_size=5), SCALARS, max_size=2),
)


def schema_fields(url: str) -> dict[str, list[str]]:
    """Request-body properties of each POST route, read from the server's OpenAPI schema."""
    schema = httpx.get(f"{url}/openapi.json").json()
    components = schema["components"]["schemas"]
    fields = {}
    for path, methods in schema["paths"].items():
        body = methods.get("post", {}).get("requestBody")
        if body:
            ref = body["content"]["application/json"]["schema"]["$ref"].rsplit("/", 1)[-1]
            fields[path] = sorted(components[ref]["properties"]) + ["unknown_field"]
    return fields


@st.composite
def bodies(draw, fields: list[str]):
    body = {"model": "toy"} if draw(st.booleans()) else {}
    for name in draw(st.lists(st.sampled_from(fields), max_size=6, unique=True)):
        body[name] = draw(VALUES)
    if draw(st.booleans()):
        body["prompt"] = draw(
            st.one_of(st.text(max_size=8), st.lists(st.integers(-3, 300), max_size=4))
        )
    if draw(st.booleans()):
        body["messages"] = [
            {
                "role": draw(st.sampled_from(["user", "system", "robot"])),
                "content": draw(st.text(max_size=8)),
            }
        ]
    if (
        isinstance(body.get("max_tokens"), int)
        and body["max_tokens"] > 8
        and body["max_tokens"] < 10**9
    ):
        body["max_tokens"] = 8  # keep each accepted request short; validation is what is fuzzed
    return body


def test_fuzzed_bodies_never_give_5xx(server):
    url, state = server
    fields = schema_fields(url)
    assert set(fields) == {"/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"}
    routes = st.sampled_from(sorted(fields)).flatmap(
        lambda path: st.tuples(st.just(path), bodies(fields[path]))
    )
    with httpx.Client(base_url=url, timeout=30) as http:

        @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
        @given(route=routes)
        def check(route):
            path, body = route
            reply = http.post(path, json=body)
            assert reply.status_code < 500, (path, body, reply.text)
            if reply.status_code >= 400:
                assert set(reply.json()["error"]) == {"message", "type", "param", "code"}

        check()
        assert http.get("/health").status_code == 200
    wait_idle(state)


def sse_events(reply: httpx.Response, on_first=None) -> list[str]:
    events = []
    for line in reply.iter_lines():
        if line.startswith("data: "):
            if not events and on_first is not None:
                on_first()
            events.append(line)
    return events


def finish_reasons(events: list[str]) -> list[str]:
    reasons = []
    for event in events:
        if event != "data: [DONE]":
            body = json.loads(event[len("data: ") :])
            reasons += [c["finish_reason"] for c in body["choices"] if c["finish_reason"]]
    return reasons


def assert_core_gone(log: str) -> None:
    """The engine-core process the server's log names has exited too."""
    pid = core_pid(log)
    deadline = time.monotonic() + 60
    while process_exists(pid):
        assert time.monotonic() < deadline, f"engine core {pid} outlived the server"
        time.sleep(0.05)


def test_sigterm_drains_in_flight_requests_and_exits_zero():
    """A request running at SIGTERM finishes normally within the drain; the process then
    exits 0. The drain allowance is far beyond what the request needs on any machine."""
    with serve_process("--shutdown-timeout", "600") as (process, url):
        body = {"model": "toy", "prompt": "drain", "max_tokens": 24, "stream": True}
        body["ignore_eos"] = True
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as reply:
            events = sse_events(reply, lambda: process.send_signal(signal.SIGTERM))
        assert events[-1] == "data: [DONE]"
        assert finish_reasons(events) == ["length"]
        assert process.wait(timeout=600) == 0
        assert_core_gone(process.stderr.read())


def test_sigterm_past_the_timeout_aborts_cleanly():
    """Work still running when the drain ends: the stream gets a final chunk with finish
    reason abort and [DONE], the waiting request a 503 error object, the log one line."""
    with serve_process("--shutdown-timeout", "1", "--max-num-seqs", "1") as (process, url):
        long = {"model": "toy", "prompt": "long", "max_tokens": 4000, "ignore_eos": True}
        waiting: dict[str, httpx.Response] = {}

        def wait_behind() -> None:
            waiting["reply"] = httpx.post(f"{url}/v1/completions", json=long, timeout=600)

        def queued() -> float:
            text = httpx.get(f"{url}/metrics").text
            return next(
                float(line.split()[-1])
                for line in text.splitlines()
                if line.startswith("vllm_rlt:num_requests_waiting{")
            )

        behind = threading.Thread(target=wait_behind)
        with httpx.stream(
            "POST", f"{url}/v1/completions", json={**long, "stream": True}, timeout=600
        ) as reply:
            lines = reply.iter_lines()  # kept: dropping it would close the stream

            def first_then_signal() -> None:
                behind.start()
                deadline = time.monotonic() + 60
                while queued() < 1:
                    assert time.monotonic() < deadline, "second request never queued"
                    time.sleep(0.05)
                process.send_signal(signal.SIGTERM)

            events = []
            for line in lines:
                if line.startswith("data: "):
                    if not events:
                        first_then_signal()
                    events.append(line)
        behind.join(timeout=600)
        assert events[-1] == "data: [DONE]"
        last_chunk = json.loads(events[-2][len("data: ") :])
        assert last_chunk["choices"][0]["finish_reason"] == "abort"
        assert finish_reasons(events) == ["abort"]
        reply = waiting["reply"]
        assert reply.status_code == 503
        assert reply.json()["error"]["type"] == "service_unavailable"
        assert process.wait(timeout=120) == 0
        log = process.stderr.read()
        assert_core_gone(log)
        assert "Traceback" not in log
        assert len([line for line in log.splitlines() if "aborting" in line]) == 1


def test_shared_decode_server_serves_and_refuses_a_prompt_its_pool_cannot_prefill():
    """`serve --kv-layout shared_decode`: the frontend's checks know a prompt takes one block
    per loop while it prefills (a 400 naming the prompt, before the engine sees it), and
    requests that fit complete, with every block back afterwards."""
    flags = ("--kv-layout", "shared_decode", "--num-blocks", "16", "--block-size", "4")
    with serve_process(*flags) as (process, url):
        too_long = {"model": "toy", "prompt": [5] * 17, "max_tokens": 2}
        reply = httpx.post(f"{url}/v1/completions", json=too_long, timeout=60)
        assert reply.status_code == 400
        error = reply.json()["error"]
        assert error["param"] == "prompt"
        assert "the prompt (17 tokens) needs 20 KV blocks while it prefills" in error["message"]
        fits = {"model": "toy", "prompt": [5] * 16, "max_tokens": 8, "ignore_eos": True}
        for _ in range(2):
            reply = httpx.post(f"{url}/v1/completions", json=fits, timeout=60)
            assert reply.status_code == 200, reply.text
            assert reply.json()["usage"]["completion_tokens"] == 8
        assert httpx.get(f"{url}/health").status_code == 200
        usage = [
            float(line.split()[-1])
            for line in httpx.get(f"{url}/metrics").text.splitlines()
            if line.startswith("vllm:kv_cache_usage_perc")
        ]
        assert usage == [0.0]


def test_speculating_server_reports_drafts_in_metrics():
    with serve_process("--speculative-tokens", "3", "--draft-loops", "1") as (process, url):
        body = {"model": "toy", "prompt": "spec", "max_tokens": 12, "temperature": 0}
        body |= {"exit_threshold": 1.0, "ignore_eos": True}
        reply = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 12
        lines = httpx.get(f"{url}/metrics").text.splitlines()

        def value(prefix: str) -> float:
            return next(float(line.split()[-1]) for line in lines if line.startswith(prefix))

        assert value("vllm:spec_decode_num_drafts") > 0
        drafted = value("vllm:spec_decode_num_draft_tokens")
        assert drafted > 0 and value("vllm:spec_decode_num_accepted_tokens") <= drafted
        per_position = [line for line in lines if "spec_decode_num_accepted_tokens_per_pos" in line]
        # one-loop drafts on four loops run up to three ahead of the verified token
        assert any('position="2"' in line for line in per_position)
