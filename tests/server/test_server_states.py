"""/health through loading, failure and a dead engine; timeouts; echo and prompt scoring."""

from __future__ import annotations

import threading
import time

import httpx
import openai
from fastapi.testclient import TestClient

from tests.server.conftest import core_engine, running_server, wait_idle
from vllm_rlt import LLM, SamplingParams
from vllm_rlt.entrypoints.openai.server import build_app
from vllm_rlt.entrypoints.openai.server_state import ServerState
from vllm_rlt.entrypoints.openai.settings import ServerSettings


def test_health_and_routes_while_loading_and_after_a_failed_load():
    state = ServerState(ServerSettings())
    with TestClient(build_app(state)) as http:
        assert http.get("/health").json() == {"status": "loading"}
        assert http.get("/health").status_code == 503
        reply = http.post("/v1/completions", json={"model": "toy", "prompt": "x"})
        assert reply.status_code == 503 and "loading" in reply.json()["error"]["message"]
        state.load_error = RuntimeError("disk on fire")
        assert http.get("/health").status_code == 503
        assert "disk on fire" in http.get("/v1/models").json()["error"]["message"]


def test_dead_engine_gives_503(server):
    url, state = server
    state.engine.dead = RuntimeError("simulated device fault")
    try:
        assert httpx.get(f"{url}/health").status_code == 503
        reply = httpx.post(f"{url}/v1/completions", json={"model": "toy", "prompt": "x"})
        assert reply.status_code == 503 and reply.json()["error"]["type"] == "service_unavailable"
    finally:
        state.engine.dead = None
    assert httpx.get(f"{url}/health").status_code == 200


def test_request_timeout_aborts_and_frees_blocks():
    with running_server(request_timeout=0.3) as (url, state):
        body = {"model": "toy", "prompt": "slow", "max_tokens": 3000, "ignore_eos": True}
        reply = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
        assert reply.status_code == 504 and reply.json()["error"]["type"] == "timeout_error"
        wait_idle(state)
        # streamed: chunks, then the error event and DONE, as vLLM ends a failed stream
        with httpx.stream(
            "POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=30
        ) as streamed:
            events = [line for line in streamed.iter_lines() if line.startswith("data: ")]
        if streamed.status_code == 200:  # else the limit came before the first chunk: a 504
            assert '"timeout_error"' in events[-2] and events[-1] == "data: [DONE]"
        else:
            assert streamed.status_code == 504
        wait_idle(state)


def test_echo_prepends_the_prompt(server):
    url, _ = server
    api = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
    plain = api.completions.create(model="toy", prompt="echo me", max_tokens=4, temperature=0.0)
    echoed = api.completions.create(
        model="toy", prompt="echo me", max_tokens=4, temperature=0.0, echo=True
    )
    assert echoed.choices[0].text == "echo me" + plain.choices[0].text


def test_echo_with_logprobs_scores_the_prompt(server):
    """lm-eval's loglikelihood call (echo, logprobs, max_tokens 0 or 1): the prompt tokens'
    logprobs (None for the first) equal the engine's prompt_logprobs, followed by the
    generated token's when one is asked for, also when streamed."""
    url, _ = server
    api = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
    prompt = "score this"
    ids = httpx.post(f"{url}/tokenize", json={"prompt": prompt}).json()["tokens"]
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=2)
    want = LLM(model="toy").generate([prompt], params, use_tqdm=False)[0].prompt_logprobs
    assert want is not None
    for max_tokens in (0, 1):
        reply = api.completions.create(
            model="toy", prompt=prompt, max_tokens=max_tokens, echo=True, logprobs=2, temperature=0
        )
        choice = reply.choices[0]
        logprobs = choice.logprobs
        assert len(logprobs.token_logprobs) == len(ids) + max_tokens
        assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
        for position in range(1, len(ids)):
            value = logprobs.token_logprobs[position]
            assert abs(value - want[position][ids[position]].logprob) < 1e-5
            top = logprobs.top_logprobs[position]  # the prompt token first, then the top 2
            assert next(iter(top.values())) == value and len(top) <= 3
            assert max(top.values()) >= value - 1e-6
        assert reply.usage.completion_tokens == max_tokens
        assert choice.text.startswith(prompt) and (max_tokens or choice.text == prompt)
        assert choice.finish_reason == "length"
        streamed = api.completions.create(
            model="toy",
            prompt=prompt,
            max_tokens=max_tokens,
            echo=True,
            logprobs=2,
            temperature=0,
            stream=True,
        )
        values = [v for chunk in streamed for v in chunk.choices[0].logprobs.token_logprobs]
        assert values == logprobs.token_logprobs


def test_vllm_sampling_extensions(server):
    """logit_bias (string keys), the three penalties and the special-token text options
    reach the engine: the server's text equals the offline engine's for the same params."""
    url, _ = server
    api = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
    adjust = {"repetition_penalty": 1.3, "frequency_penalty": 0.6, "presence_penalty": -0.4}
    reply = api.completions.create(
        model="toy",
        prompt="adjust me",
        max_tokens=8,
        temperature=0,
        logit_bias={"65": 10.0},
        extra_body={**adjust, "ignore_eos": True},
    )
    params = SamplingParams(
        max_tokens=8, temperature=0.0, logit_bias={65: 10.0}, ignore_eos=True, **adjust
    )
    want = LLM(model="toy").generate(["adjust me"], params, use_tqdm=False)[0].outputs[0]
    assert reply.choices[0].text == want.text
    end = {"logit_bias": {"2": 100.0}, "ignore_eos": True, "max_tokens": 2}  # <|im_end|>
    body = {"model": "toy", "prompt": "x", "temperature": 0, **end}
    texts = [
        httpx.post(f"{url}/v1/completions", json={**body, **flags}).json()["choices"][0]["text"]
        for flags in (
            {},
            {"skip_special_tokens": False},
            {"skip_special_tokens": False, "spaces_between_special_tokens": False},
        )
    ]
    # the space rule also separates the first one from the prompt's text before it
    assert texts == ["", " <|im_end|> <|im_end|>", "<|im_end|><|im_end|>"]
    # allowed_token_ids reaches the engine: "a" and "b" (bytes + 3) alone, whatever the bias
    only = {"allowed_token_ids": [100, 101], "logit_bias": {"65": 100.0}, "ignore_eos": True}
    text = httpx.post(f"{url}/v1/completions", json={**body, **only, "max_tokens": 6}).json()
    assert set(text["choices"][0]["text"]) <= {"a", "b"} and text["choices"][0]["text"]
    # bad_words reach the engine as token ids: "b" may follow no "a", "a" may not start
    pairs = {"allowed_token_ids": [100, 101], "ignore_eos": True, "max_tokens": 8}
    for words, banned in ((["ab"], "ab"), (["a"], "a")):
        reply = httpx.post(f"{url}/v1/completions", json={**body, **pairs, "bad_words": words})
        assert reply.status_code == 200, reply.text
        assert banned not in reply.json()["choices"][0]["text"]
    for field, value, message in (
        ("logit_bias", {"a": 1.0}, "logit_bias.a: must be a token id in [0, 258] (decimal"),
        ("logit_bias", {"99999": 1.0}, "logit_bias.99999: must be a token id in [0, 258]"),
        ("logit_bias", {"3": 500}, "must be in [-100.0, 100.0]"),
        ("presence_penalty", 3, "presence_penalty: must be in [-2.0, 2.0], got 3"),
        ("repetition_penalty", 0, "repetition_penalty: must be in [1e-30, 10.0], got 0"),
        ("allowed_token_ids", [], "allowed_token_ids"),
        ("allowed_token_ids", [99999], "allowed_token_ids.0: must be a token id in [0, 258]"),
        ("allowed_token_ids", [-3], "allowed_token_ids.0: must be a token id in [0, 258]"),
        ("bad_words", [], "bad_words"),
        ("bad_words", ["x" * 9], "bad word 'xxxxxxxxx' is 9 tokens without a leading space"),
        ("bad_words", ["  "], "bad_words: must hold non-blank strings"),
    ):
        reply = httpx.post(f"{url}/v1/completions", json={**body, field: value})
        assert reply.status_code == 400, (field, value)
        error = reply.json()["error"]
        assert error["param"] is not None and error["param"].startswith(field), error
        assert message in error["message"], error


def test_max_tokens_zero_needs_echo(server):
    url, _ = server
    body = {"model": "toy", "prompt": "x", "max_tokens": 0}
    reply = httpx.post(f"{url}/v1/completions", json=body)
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert error["param"] == "max_tokens" and "only allowed with echo" in error["message"]


def test_tokenizer_info_for_remote_tokenizers(server):
    url, _ = server
    info = httpx.get(f"{url}/tokenizer_info").json()
    assert info["eos_token"] is not None and info["chat_template"]
    tokens = httpx.post(f"{url}/tokenize", json={"prompt": "abc"}).json()["tokens"]
    back = httpx.post(f"{url}/detokenize", json={"tokens": tokens}).json()["prompt"]
    assert back == "abc"


def test_one_failing_request_fails_alone(monkeypatch):
    """An unexpected error while the core takes one request in fails that request only."""
    with running_server(in_process=True) as (url, state):
        engine = core_engine(state)
        original = engine.add_request

        def flaky(request_id, ids, params, **options):
            if params.seed == 666:
                raise RuntimeError("boom")
            return original(request_id, ids, params, **options)

        monkeypatch.setattr(engine, "add_request", flaky)
        body = {"model": "toy", "prompt": "explode", "seed": 666}
        bad = httpx.post(f"{url}/v1/completions", json=body)
        good = httpx.post(f"{url}/v1/completions", json={"model": "toy", "prompt": "fine"})
        assert bad.status_code == 500 and "boom" in bad.json()["error"]["message"]
        assert good.status_code == 200 and good.json()["choices"][0]["finish_reason"]
        assert httpx.get(f"{url}/health").status_code == 200
        wait_idle(state)


def test_health_fails_while_work_waits_without_progress(monkeypatch):
    """Passes that take longer than the stall timeout (a stuck device, here a slow step)
    make /health fail while work waits; once idle it is healthy again."""
    with running_server(stall_timeout=0.3, in_process=True) as (url, state):
        engine = core_engine(state)
        original = engine.step

        def slow_step():
            time.sleep(0.6)
            return original()

        monkeypatch.setattr(engine, "step", slow_step)
        body = {"model": "toy", "prompt": "s", "max_tokens": 1, "ignore_eos": True}
        with httpx.Client(timeout=30) as http:
            pending = threading.Thread(
                target=http.post, args=(f"{url}/v1/completions",), kwargs={"json": body}
            )
            pending.start()
            codes = set()
            for _ in range(40):
                codes.add(http.get(f"{url}/health").status_code)
                time.sleep(0.05)
            pending.join()
        assert 503 in codes
        monkeypatch.setattr(engine, "step", original)
        wait_idle(state)
        assert httpx.get(f"{url}/health").status_code == 200


def test_generation_config_reaches_the_server(tmp_path):
    """--generation-config FOLDER: unset request fields take that folder's values."""
    (tmp_path / "generation_config.json").write_text('{"temperature": 0.0, "top_k": 3}')
    with running_server(in_process=True, generation_config=str(tmp_path)) as (url, state):
        assert state.engine.processor.sampling_defaults == {"temperature": 0.0, "top_k": 3}
        body = {"model": "toy", "prompt": "x", "max_tokens": 3, "ignore_eos": True}
        first, second = (httpx.post(f"{url}/v1/completions", json=body) for _ in range(2))
        assert first.json()["choices"][0]["text"] == second.json()["choices"][0]["text"]


def test_sleep_mode_endpoints():
    """--enable-sleep-mode: the engine sleeps and wakes over HTTP with its outputs kept,
    refuses requests while asleep, resets its prefix cache; without the flag the routes do
    not exist, and the API key guards them."""
    body = {"model": "toy", "prompt": "sleep well", "max_tokens": 4, "temperature": 0}
    with running_server(in_process=True, enable_sleep_mode=True) as (url, _):
        want = httpx.post(f"{url}/v1/completions", json=body).json()["choices"][0]["text"]
        assert httpx.post(f"{url}/sleep", params={"level": 3}).status_code == 400
        assert httpx.post(f"{url}/sleep", params={"level": 2}).status_code == 400
        assert httpx.post(f"{url}/sleep", params={"level": 1}).json() == {"is_sleeping": True}
        assert httpx.get(f"{url}/is_sleeping").json() == {"is_sleeping": True}
        asleep = httpx.post(f"{url}/v1/completions", json=body)
        assert asleep.status_code == 400 and "sleeping" in asleep.json()["error"]["message"]
        # asleep already, awake already: both no-ops that answer the state, as in vLLM
        assert httpx.post(f"{url}/sleep").json() == {"is_sleeping": True}
        assert httpx.post(f"{url}/wake_up").json() == {"is_sleeping": False}
        assert httpx.post(f"{url}/wake_up").json() == {"is_sleeping": False}
        again = httpx.post(f"{url}/v1/completions", json=body).json()["choices"][0]["text"]
        assert again == want
        httpx.post(f"{url}/sleep")  # and in two steps, as vLLM's tags do it
        bad = httpx.post(f"{url}/wake_up", params={"tags": "optimizer"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "tags"
        woken = httpx.post(f"{url}/wake_up", params={"tags": "weights"}).json()
        assert woken == {"is_sleeping": True}
        assert httpx.post(f"{url}/v1/completions", json=body).status_code == 400
        woken = httpx.post(f"{url}/wake_up", params={"tags": ["kv_cache"]}).json()
        assert woken == {"is_sleeping": False}
        again = httpx.post(f"{url}/v1/completions", json=body).json()["choices"][0]["text"]
        assert again == want
        assert httpx.post(f"{url}/reset_prefix_cache").json() == {"reset": True}
        assert httpx.get(f"{url}/health").status_code == 200
    with running_server(in_process=True) as (url, _):
        assert httpx.post(f"{url}/sleep").status_code == 404
    with running_server(in_process=True, enable_sleep_mode=True, api_key="k") as (url, _):
        assert httpx.post(f"{url}/wake_up").status_code == 401
        headers = {"Authorization": "Bearer k"}
        assert httpx.get(f"{url}/is_sleeping", headers=headers).json() == {"is_sleeping": False}
