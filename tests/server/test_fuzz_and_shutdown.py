"""Random request bodies never cause a 5xx; SIGTERM lets in-flight requests finish."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.server.conftest import _free_port, wait_idle

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


def test_sigterm_drains_in_flight_requests_and_exits_zero():
    port = _free_port()
    root = Path(__file__).resolve().parents[2]
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "vllm_rlt.entrypoints.cli",
            "serve",
            "toy",
            "--port",
            str(port),
            "--shutdown-timeout",
            "30",
        ],
        cwd=root,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{url}/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "server did not come up"
            time.sleep(0.1)
        body = {
            "model": "toy",
            "prompt": "drain",
            "max_tokens": 300,
            "stream": True,
            "ignore_eos": True,
        }
        events = []
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as reply:
            for line in reply.iter_lines():
                if not line.startswith("data: "):
                    continue
                if not events:
                    process.send_signal(signal.SIGTERM)
                events.append(line)
        assert events[-1] == "data: [DONE]"
        finishes = [e for e in events if '"finish_reason": "length"' in e]
        assert len(finishes) == 1
        assert process.wait(timeout=60) == 0
    finally:
        if process.poll() is None:
            process.kill()
