"""`use_beam_search` over HTTP, as vLLM's: the n choices are the n best beams, the same as
`LLM.beam_search` on the same model, whole or streamed, with logprobs cut to what was
asked; bad combinations are 400s naming the field; a client that leaves mid-search frees
every block."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.server.conftest import (
    assert_error,
    assert_healthy,
    running_server,
    wait_idle,
    wait_until,
)
from vllm_rlt import LLM
from vllm_rlt.sampling_params import BeamSearchParams

PROMPT = [184, 257, 12, 130]
BEAM = {"use_beam_search": True, "n": 3, "max_tokens": 5, "ignore_eos": True}


@pytest.fixture(scope="module")
def offline():
    return LLM(model="toy")


def _post(url: str, path: str, body: dict, **kwargs) -> httpx.Response:
    return httpx.post(f"{url}{path}", json={"model": "toy", **body}, timeout=60, **kwargs)


def test_choices_are_the_offline_beams(server, offline):
    url, _ = server
    want = offline.beam_search([PROMPT], BeamSearchParams(3, 5, ignore_eos=True))[0].sequences
    body = {"prompt": PROMPT, "return_token_ids": True, "logprobs": 2, **BEAM}
    reply = _post(url, "/v1/completions", body).json()
    choices = reply["choices"]
    assert [c["token_ids"] for c in choices] == [s.token_ids for s in want]
    assert [c["index"] for c in choices] == [0, 1, 2]
    assert all(c["finish_reason"] == "length" for c in choices)
    # each position: the token and the two best of its step, as logprobs=2 asks
    assert all(len(top) <= 3 for c in choices for top in c["logprobs"]["top_logprobs"])
    assert reply["usage"]["completion_tokens"] == 15
    streamed = _post(url, "/v1/completions", {**body, "stream": True})
    events = [
        json.loads(line[6:]) for line in streamed.text.splitlines() if line.startswith("data: {")
    ]
    texts = {}
    for event in events:
        for choice in event["choices"]:
            texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
    assert [texts[i] for i in range(3)] == [c["text"] for c in choices]


def test_chat_takes_beams_too(server, offline):
    url, _ = server
    messages = [{"role": "user", "content": "hi"}]
    rendered = httpx.post(f"{url}/tokenize", json={"messages": messages}).json()["tokens"]
    want = offline.beam_search([rendered], BeamSearchParams(2, 4, ignore_eos=True))[0]
    body = {"messages": messages, "return_token_ids": True, **BEAM, "n": 2, "max_tokens": 4}
    reply = _post(url, "/v1/chat/completions", body).json()
    assert [c["token_ids"] for c in reply["choices"]] == [s.token_ids for s in want.sequences]


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"n": 11}, "n", "must be in [1, 10] with use_beam_search"),
        ({"echo": True}, "echo", "not available with use_beam_search"),
        ({"prompt_logprobs": 1}, "prompt_logprobs", "not available"),
        ({"length_penalty": "x"}, "length_penalty", "length_penalty: "),
    ],
)
def test_bad_combinations_are_named(server, body, param, words):
    url, _ = server
    reply = _post(url, "/v1/completions", {"prompt": PROMPT, **BEAM, **body})
    assert words in assert_error(reply, 400, param)["message"]


def test_a_client_that_leaves_frees_the_search(server):
    url, state = server
    body = {"model": "toy", "prompt": PROMPT, **BEAM, "n": 8, "max_tokens": 2000}
    for stream in (False, True):
        with pytest.raises(httpx.ReadTimeout):  # leave while the search runs
            httpx.post(f"{url}/v1/completions", json={**body, "stream": stream}, timeout=0.5)
        wait_idle(state)
    assert_healthy(url)


def test_an_infinite_length_penalty_is_named(server):
    url, _ = server
    raw = json.dumps({"model": "toy", "prompt": PROMPT, **BEAM}).rstrip("}")
    reply = httpx.post(
        f"{url}/v1/completions",
        content=raw + ', "length_penalty": 1e999}',
        headers={"content-type": "application/json"},
    )
    assert "finite number, got inf" in assert_error(reply, 400, "length_penalty")["message"]


def test_a_pause_or_a_shutdown_ends_a_search_as_it_ends_a_request():
    """An aborting pause ends a search with its beams so far and finish reason abort (a
    step came back without logprobs: it was a 500); a shutdown answers 503, and no step
    starts after it (the search went on between steps)."""
    body = {"model": "toy", "prompt": PROMPT, **BEAM, "n": 4, "max_tokens": 2000}
    with running_server(in_process=True, enable_weight_updates=True) as (url, state):
        with ThreadPoolExecutor(2) as pool:
            paused = pool.submit(httpx.post, f"{url}/v1/completions", json=body, timeout=60)
            wait_until(lambda: state.engine.num_requests > 0)
            assert httpx.post(f"{url}/pause", params={"mode": "abort"}).status_code == 200
            reply = paused.result()
            assert httpx.post(f"{url}/resume").status_code == 200
            assert reply.status_code == 200, reply.text
            assert {c["finish_reason"] for c in reply.json()["choices"]} == {"abort"}
            whole, streamed = (
                pool.submit(httpx.post, f"{url}/v1/completions", json={**body, "stream": each})
                for each in (False, True)
            )
            wait_until(lambda: state.engine.num_requests >= 8)  # both searches run a step
            state.abort_all()  # what the server's shutdown does after its timeout
            assert whole.result().status_code == 503
            assert "shut down before the request finished" in streamed.result().text
        wait_idle(state)
