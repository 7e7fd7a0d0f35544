"""The server through the official openai client and raw HTTP."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server.conftest import check_concurrent_streams, running_server, wait_idle
from vllm_rlt import LLM, SamplingParams
from vllm_rlt.entrypoints.openai.response_shapes import ResponseShapes


def client(url: str, key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)


def test_completion_usage_and_exit_depths(server):
    url, state = server
    reply = client(url).completions.create(
        model="toy",
        prompt="Hello",
        max_tokens=6,
        temperature=0.0,
        extra_body={"return_exit_depths": True, "exit_threshold": 0.5, "ignore_eos": True},
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "length"
    assert reply.usage.prompt_tokens == 5 and reply.usage.completion_tokens == 6
    assert reply.usage.total_tokens == 11
    depths = choice.model_extra["exit_depths"]
    assert len(depths) == 6 and depths[0] == 4 and all(1 <= d <= 4 for d in depths)
    offline = (
        LLM(model="toy")
        .generate(
            "Hello",
            SamplingParams(max_tokens=6, temperature=0.0, exit_threshold=0.5, ignore_eos=True),
            use_tqdm=False,
        )[0]
        .outputs[0]
    )
    assert choice.text == offline.text and depths == offline.exit_depths
    wait_idle(state)


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_streamed_text_equals_non_streamed(server, chat):
    url, _ = server
    api = client(url)
    common = dict(model="toy", max_tokens=24, temperature=0.9, seed=5, top_p=0.95)
    if chat:
        messages = [{"role": "user", "content": "Tell me about loops"}]
        whole = api.chat.completions.create(messages=messages, **common)
        parts, reasons, roles = [], [], []
        stream = api.chat.completions.create(messages=messages, stream=True, n=2, **common)
        for chunk in stream:
            for choice in chunk.choices:
                roles.append((choice.index, choice.delta.role, choice.delta.content))
                if choice.index == 0:
                    parts.append(choice.delta.content or "")
                    reasons.append(choice.finish_reason)
        # vLLM's and OpenAI's first event per choice: the role alone, with empty content
        assert roles[:2] == [(0, "assistant", ""), (1, "assistant", "")]
        assert all(role is None for _, role, _ in roles[2:])
        expected = whole.choices[0].message.content
    else:
        whole = api.completions.create(prompt="Loops and exits", **common)
        parts, reasons = [], []
        for chunk in api.completions.create(prompt="Loops and exits", stream=True, **common):
            for choice in chunk.choices:
                parts.append(choice.text)
                reasons.append(choice.finish_reason)
        expected = whole.choices[0].text
    assert "".join(parts) == expected
    assert [r for r in reasons if r is not None] == [whole.choices[0].finish_reason]


def test_n_choices_and_usage_chunk(server):
    url, _ = server
    api = client(url)
    reply = api.completions.create(
        model="toy", prompt=["abc", "xyz"], n=2, max_tokens=8, temperature=1.0, seed=11
    )
    assert sorted(c.index for c in reply.choices) == [0, 1, 2, 3]
    texts = [c.text for c in sorted(reply.choices, key=lambda c: c.index)]
    assert texts[0] != texts[1] and texts[2] != texts[3]
    assert reply.usage.prompt_tokens == 6
    assert 4 <= reply.usage.completion_tokens <= 4 * 8
    chunks = list(
        api.completions.create(
            model="toy",
            prompt="abc",
            n=2,
            max_tokens=5,
            seed=3,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    finishes = {}
    for chunk in chunks[:-1]:
        for choice in chunk.choices:
            if choice.finish_reason is not None:
                assert choice.index not in finishes, "two finish reasons for one choice"
                finishes[choice.index] = choice.finish_reason
    assert sorted(finishes) == [0, 1]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens >= 2


def test_stop_strings_and_logprobs(server):
    url, _ = server
    api = client(url)
    base = (
        api.completions.create(
            model="toy",
            prompt="The quick brown fox",
            max_tokens=16,
            temperature=0.0,
            extra_body={"ignore_eos": True},
        )
        .choices[0]
        .text
    )
    printable = [i for i in range(2, len(base) - 2) if base[i : i + 2].isprintable()]
    assert printable, f"no usable stop string in {base!r}"
    stop = base[printable[0] : printable[0] + 2]
    stopped = api.completions.create(
        model="toy",
        prompt="The quick brown fox",
        max_tokens=16,
        temperature=0.0,
        stop=stop,
        extra_body={"ignore_eos": True},
    ).choices[0]
    assert stopped.finish_reason == "stop" and stopped.text == base[: base.find(stop)]
    reply = api.completions.create(
        model="toy",
        prompt="The quick brown fox",
        max_tokens=16,
        temperature=0.0,
        stop=stop,
        extra_body={"ignore_eos": True, "return_exit_depths": True},
    )
    offline = (
        LLM(model="toy")
        .generate(
            "The quick brown fox",
            SamplingParams(max_tokens=16, temperature=0.0, stop=stop, ignore_eos=True),
            use_tqdm=False,
        )[0]
        .outputs[0]
    )
    assert reply.usage.completion_tokens == len(offline.token_ids)
    assert reply.choices[0].model_extra["exit_depths"] == offline.exit_depths
    reply = api.completions.create(
        model="toy", prompt="ab", max_tokens=4, logprobs=3, temperature=0.0
    )
    logprobs = reply.choices[0].logprobs
    assert len(logprobs.tokens) == 4 and len(logprobs.token_logprobs) == 4
    assert all(len(top) == 3 for top in logprobs.top_logprobs)
    assert all(lp <= 0 for lp in logprobs.token_logprobs)
    chat = api.chat.completions.create(
        model="toy",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=3,
        logprobs=True,
        top_logprobs=2,
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == 3 and all(len(entry.top_logprobs) == 2 for entry in content)


def test_errors_use_the_openai_error_object(server):
    url, state = server
    api = client(url)
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        api.completions.create(model="toy", prompt="x", max_tokens=0)
    with pytest.raises(openai.NotFoundError):
        api.completions.create(model="nope", prompt="x", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="context length"):
        api.completions.create(model="toy", prompt="x", max_tokens=5000)
    with pytest.raises(openai.BadRequestError, match="best_of: is not supported"):
        api.completions.create(model="toy", prompt="x", max_tokens=2, best_of=2)
    with pytest.raises(openai.BadRequestError, match="max_loops"):
        api.completions.create(model="toy", prompt="x", max_tokens=2, extra_body={"max_loops": 9})
    for body in (b"{not json", b'{"model": "toy", "prompt": 5}', b'{"model": "toy"}', b"[]"):
        reply = httpx.post(
            f"{url}/v1/completions", content=body, headers={"content-type": "application/json"}
        )
        assert reply.status_code == 400, body
        error = reply.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["code"] == 400
    assert httpx.get(f"{url}/health").status_code == 200
    wait_idle(state)


def test_concurrent_streams_equal_offline_generation(server):
    """64 streaming clients at once; each output equals LLM.generate with the same seed."""
    url, state = server
    check_concurrent_streams(url, 64)
    wait_idle(state)


def test_disconnect_mid_stream_frees_blocks(server):
    url, state = server
    body = {
        "model": "toy",
        "prompt": "long one",
        "max_tokens": 2000,
        "stream": True,
        "ignore_eos": True,
    }
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=30) as reply:
        lines = reply.iter_lines()  # kept: dropping the iterator would close the stream
        while not next(lines).startswith("data: "):
            pass
        stats = state.engine.engine_stats()
        assert stats.num_free_blocks < stats.num_blocks
    wait_idle(state)


def test_non_streaming_disconnect_aborts(server):
    url, state = server
    body = {"model": "toy", "prompt": "long one", "max_tokens": 3000, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{url}/v1/completions", json=body, timeout=0.5)
    wait_idle(state)


def test_queue_overflow_gives_429():
    with running_server(max_num_seqs=1, max_queue=1) as (url, state):
        body = {"model": "toy", "prompt": "q", "max_tokens": 100, "ignore_eos": True}

        async def fire() -> list[int]:
            async with httpx.AsyncClient(timeout=60) as http:
                replies = await asyncio.gather(
                    *(http.post(f"{url}/v1/completions", json=body) for _ in range(6))
                )
            return [r.status_code for r in replies]

        codes = asyncio.run(fire())
        assert 429 in codes and 200 in codes and set(codes) <= {200, 429}
        wait_idle(state)


def test_api_key_on_every_route_but_the_probes():
    with running_server(api_key="sekrit") as (url, _):
        assert httpx.get(f"{url}/health").json() == {"status": "ok"}
        for method, path in (("HEAD", "/health"), ("GET", "/ping"), ("POST", "/ping")):
            assert httpx.request(method, f"{url}{path}").status_code == 200
        schema = httpx.get(f"{url}/openapi.json", headers={"Authorization": "Bearer sekrit"})
        operations = [op for methods in schema.json()["paths"].values() for op in methods.values()]
        ids = [operation["operationId"] for operation in operations]
        assert len(ids) == len(set(ids)) and {"health_head", "ping_post"} <= set(ids)
        for path in ("/v1/models", "/metrics", "/version"):
            reply = httpx.get(f"{url}{path}")
            assert (
                reply.status_code == 401 and reply.json()["error"]["type"] == "authentication_error"
            )
        with pytest.raises(openai.AuthenticationError):
            client(url, "wrong").models.list()
        assert [m.id for m in client(url, "sekrit").models.list()] == ["toy"]


def test_body_limit():
    with running_server(max_body_bytes=200) as (url, _):
        reply = httpx.post(f"{url}/v1/completions", json={"model": "toy", "prompt": "x" * 500})
        assert reply.status_code == 413 and reply.json()["error"]["code"] == 413


def test_tokenize_detokenize_version(server):
    url, _ = server
    tokens = httpx.post(f"{url}/tokenize", json={"prompt": "héllo"}).json()
    assert tokens["count"] == 6 and tokens["max_model_len"] == 4096
    text = httpx.post(f"{url}/detokenize", json={"tokens": tokens["tokens"]}).json()["prompt"]
    assert text == "héllo"
    chat = httpx.post(f"{url}/tokenize", json={"messages": [{"role": "user", "content": "x"}]})
    assert chat.json()["tokens"][0] == 1  # <|im_start|>
    assert httpx.post(f"{url}/detokenize", json={"tokens": [999]}).status_code == 400
    assert httpx.get(f"{url}/version").json()["version"]
    assert "paths" in httpx.get(f"{url}/openapi.json").json()


def test_metrics_parse_and_move(server):
    url, state = server

    def sample(name: str) -> float:
        text = httpx.get(f"{url}/metrics").text
        for family in text_string_to_metric_families(text):
            for metric in family.samples:
                if metric.name == name:
                    return metric.value
        raise AssertionError(f"{name} missing")

    before = sample("vllm_rlt:generation_tokens_total")
    depth_before = sample("vllm_rlt:exit_depth_count")
    queries, hits = (
        sample("vllm_rlt:prefix_cache_queries_total"),
        sample("vllm_rlt:prefix_cache_hits_total"),
    )
    prompt = "metrics of a prompt longer than a block, sent twice"
    for _ in range(2):
        client(url).completions.create(
            model="toy", prompt=prompt, max_tokens=7, extra_body={"ignore_eos": True}
        )
    wait_idle(state)
    prompt_len = len(prompt.encode())
    assert sample("vllm_rlt:prefix_cache_queries_total") == queries + 2 * prompt_len
    # The second time every full block but the one holding the last position is cached.
    assert sample("vllm_rlt:prefix_cache_hits_total") == hits + (prompt_len - 1) // 16 * 16
    assert sample("vllm_rlt:num_cached_blocks") >= (prompt_len - 1) // 16
    assert sample("vllm_rlt:generation_tokens_total") == before + 14
    assert sample("vllm_rlt:exit_depth_count") == depth_before + 12
    assert sample("vllm_rlt:passes_total") > 0
    assert sample("vllm_rlt:time_to_first_token_seconds_count") >= 1
    assert 1 <= sample("vllm_rlt:mean_loops_per_token") <= 4
    json.dumps(sample("vllm_rlt:kv_cache_usage_perc"))


def test_chat_without_max_tokens_runs_until_the_pool_is_full():
    """Blocks are taken as tokens come, so a chat without max_tokens may use the whole
    context: here the 8-block pool (128 positions) is smaller than the model's."""
    with running_server(num_blocks=8, max_num_seqs=2) as (url, state):
        reply = httpx.post(
            f"{url}/v1/chat/completions",
            json={
                "model": "toy",
                "messages": [{"role": "user", "content": "go"}],
                "ignore_eos": True,
            },
            timeout=300,
        ).json()
        usage = reply["usage"]
        assert reply["choices"][0]["finish_reason"] == "length"
        assert usage["prompt_tokens"] + usage["completion_tokens"] == 8 * 16
        wait_idle(state)


def test_vllm_metric_names_mirror_ours_with_the_model_name(server):
    """Routers and dashboards read vLLM's names: each is the same figure as ours, labelled
    with the served model's name."""
    from vllm_rlt.entrypoints.openai.metrics import VLLM_NAMES

    url, state = server
    client(url).completions.create(model="toy", prompt="for the routers", max_tokens=3)
    wait_idle(state)
    families = {
        family.name: family
        for family in text_string_to_metric_families(httpx.get(f"{url}/metrics").text)
    }
    for ours, theirs in VLLM_NAMES.items():
        # the parser drops the _total of counters from family names
        ours, theirs = ours.removesuffix("_total"), theirs.removesuffix("_total")
        assert theirs in families, f"{theirs} missing"
        mine = {
            (s.name.split(":", 1)[1], tuple(sorted(s.labels.items()))): s.value
            for s in families[ours].samples
        }
        for sample in families[theirs].samples:
            labels = dict(sample.labels)
            assert labels.pop("model_name") == "toy"
            key = (sample.name.split(":", 1)[1], tuple(sorted(labels.items())))
            assert key in mine and sample.value == mine[key], (theirs, key)


def test_a_client_that_leaves_mid_stream_is_counted_as_aborted(server):
    """Its request ends in the metrics too: one success with finish reason abort and its
    end-to-end latency, once the server has noticed the disconnect."""
    url, state = server

    def aborted() -> tuple[float, float]:
        text = httpx.get(f"{url}/metrics").text
        found = {"abort": 0.0, "e2e": 0.0}
        for family in text_string_to_metric_families(text):
            for metric in family.samples:
                if metric.name == "vllm_rlt:request_success_total":
                    if metric.labels.get("finished_reason") == "abort":
                        found["abort"] = metric.value
                if metric.name == "vllm_rlt:e2e_request_latency_seconds_count":
                    found["e2e"] = metric.value
        return found["abort"], found["e2e"]

    before = aborted()
    body = {"model": "toy", "prompt": "leave", "max_tokens": 3000, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json={**body, "ignore_eos": True}) as r:
        next(line for line in r.iter_lines() if line.startswith("data: "))
    wait_idle(state)
    for _ in range(600):  # the disconnect is noticed asynchronously
        if aborted() == (before[0] + 1, before[1] + 1):
            break
        time.sleep(0.1)
    assert aborted() == (before[0] + 1, before[1] + 1)


def test_a_large_body_is_built_off_the_event_loop(server, monkeypatch):
    """Many tokens with logprobs take a worker thread to shape and render; a small answer
    stays on the event loop (a thread hop would cost it more than the work)."""
    url, _ = server
    threads = []
    choice = ResponseShapes.choice

    def recording(self, *args):
        threads.append(threading.current_thread().name)
        return choice(self, *args)

    monkeypatch.setattr(ResponseShapes, "choice", recording)
    small = {"model": "toy", "prompt": "x", "max_tokens": 4}
    large = {**small, "max_tokens": 1100, "ignore_eos": True, "logprobs": 1}
    for body in (small, large):
        reply = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
        assert reply.status_code == 200 and reply.headers["content-type"] == "application/json"
    assert len(reply.json()["choices"][0]["logprobs"]["tokens"]) == 1100
    on_loop, on_worker = threads
    assert on_loop != on_worker  # the event loop thread, then one of its workers
