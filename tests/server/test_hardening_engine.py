"""One request's trouble stays its own: a client that leaves frees its place at once, a
failure in one request's state fails it alone, an engine death is logged with its cause,
and the queue bound counts only the requests that wait."""

from __future__ import annotations

import asyncio
import json
import logging

import httpx
import pytest

from tests.server.conftest import (
    assert_error,
    assert_healthy,
    core_engine,
    running_server,
    wait_idle,
    wait_until,
)
from vllm_rlt.engine.engine_args import EngineArgs
from vllm_rlt.engine.output_processor import RequestState


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
