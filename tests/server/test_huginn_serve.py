"""A tiny Huginn folder served over HTTP: adaptive depth per request (exit_threshold,
min_loops, max_loops), a seeded request reproduced, and an out-of-range knob refused by
name while the server stays up."""

from __future__ import annotations

import httpx
import pytest

from tests.reference.huginn_checkpoint import write_tiny_huginn
from tests.server.conftest import running_server

PROMPT = [5, 17, 42, 101, 7, 250]


@pytest.fixture(scope="module")
def huginn_url(tmp_path_factory):
    folder = tmp_path_factory.mktemp("huginn")
    write_tiny_huginn(folder, seed=5)
    with running_server(num_blocks=128, model=str(folder), dtype="float32") as (url, _):
        yield url


def _complete(url: str, **fields) -> httpx.Response:
    name = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
    body = {"model": name, "prompt": PROMPT, "max_tokens": 6, "temperature": 0}
    body["return_exit_depths"] = True
    return httpx.post(f"{url}/v1/completions", json=body | fields, timeout=60)


def test_each_request_picks_its_depth(huginn_url):
    full = _complete(huginn_url, seed=3).json()["choices"][0]
    assert full["exit_depths"] == [8] * 6  # the default exit_threshold 0: every loop
    fixed = _complete(huginn_url, seed=3, max_loops=3).json()["choices"][0]
    assert fixed["exit_depths"] == [8] + [3] * 5  # the prompt always runs every loop
    adaptive = _complete(huginn_url, seed=3, exit_threshold=0.5).json()["choices"][0]
    assert 1 < len(set(adaptive["exit_depths"]))
    assert all(1 <= d <= 8 for d in adaptive["exit_depths"])
    late = _complete(huginn_url, seed=3, exit_threshold=0.5, min_loops=8).json()
    assert late["choices"][0]["exit_depths"] == [8] * 6


def test_a_seeded_request_reproduces(huginn_url):
    first = _complete(huginn_url, seed=9, temperature=1.0).json()["choices"][0]
    again = _complete(huginn_url, seed=9, temperature=1.0).json()["choices"][0]
    assert first == again


def test_a_bad_knob_is_refused_by_name(huginn_url):
    response = _complete(huginn_url, exit_threshold=1.5)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "exit_threshold"
    assert _complete(huginn_url, seed=1).status_code == 200
