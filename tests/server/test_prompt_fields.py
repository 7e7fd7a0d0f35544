"""vLLM's prompt and stream fields over HTTP: truncate_prompt_tokens keeps a prompt's last
tokens (what the reply counts, echoes and returns agrees with what ran),
add_special_tokens reaches the tokenizer (completions: on, chat: off, as vLLM's), and
stream_options.continuous_usage_stats puts each choice's usage so far in every event."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import httpx

from vllm_rlt.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    TokenizeRequest,
)
from vllm_rlt.entrypoints.openai.request_jobs import RequestJobs, request_ids
from vllm_rlt.tokenizer import Tokenizer, build_byte_tokenizer

PROMPT = [184, 257, 12, 130]


def _post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}{path}", json={"model": "toy", **body}, timeout=60)


def test_truncate_prompt_tokens_keeps_the_last_tokens(server):
    url, _ = server
    greedy = {"max_tokens": 4, "temperature": 0.0, "return_token_ids": True}
    kept = _post(url, "/v1/completions", {"prompt": PROMPT[-2:], **greedy}).json()
    cut = _post(url, "/v1/completions", {"prompt": PROMPT, "truncate_prompt_tokens": 2, **greedy})
    choice = cut.json()["choices"][0]
    assert choice["prompt_token_ids"] == PROMPT[-2:]
    assert choice["token_ids"] == kept["choices"][0]["token_ids"]
    assert cut.json()["usage"]["prompt_tokens"] == 2
    whole = _post(
        url, "/v1/completions", {"prompt": PROMPT, "truncate_prompt_tokens": -1, **greedy}
    )
    assert whole.json()["choices"][0]["prompt_token_ids"] == PROMPT
    # a text prompt echoes the text that ran
    text = "hello there"
    ids = httpx.post(f"{url}/tokenize", json={"prompt": text}).json()["tokens"]
    echoed = _post(
        url,
        "/v1/completions",
        {"prompt": text, "truncate_prompt_tokens": 3, "echo": True, "max_tokens": 0},
    )
    shown = httpx.post(f"{url}/detokenize", json={"tokens": ids[-3:]}).json()["prompt"]
    assert echoed.json()["choices"][0]["text"] == shown
    messages = [{"role": "user", "content": "hi there"}]
    rendered = httpx.post(f"{url}/tokenize", json={"messages": messages}).json()["tokens"]
    chat = {"messages": messages, "truncate_prompt_tokens": 3, **greedy}
    reply = _post(url, "/v1/chat/completions", chat).json()
    assert reply["prompt_token_ids"] == rendered[-3:] and reply["usage"]["prompt_tokens"] == 3
    for value, path in (
        (0, "/v1/completions"),
        (-2, "/v1/completions"),
        (10**9, "/v1/chat/completions"),
    ):
        body = {"prompt": PROMPT} if path == "/v1/completions" else {"messages": messages}
        refused = _post(url, path, {**body, "truncate_prompt_tokens": value})
        assert refused.status_code == 400, value
        error = refused.json()["error"]
        assert error["param"] == "truncate_prompt_tokens", value
        assert error["message"] == (
            f"truncate_prompt_tokens: must be -1 (the model's context) or in [1, 4096], got {value}"
        )
    for value in ("5", 2.0, True):
        refused = _post(url, "/v1/completions", {"prompt": PROMPT, "truncate_prompt_tokens": value})
        assert refused.json()["error"]["message"] == (
            "truncate_prompt_tokens: must be an integer (allowed: -1 or [1, 4096])"
        )


class _Tokenizer:
    """Adds a BOS (1) when asked to, and records each call's choice."""

    def __init__(self) -> None:
        self.asked: list[bool] = []

    def encode(self, text: str, add_special_tokens: bool, **_) -> list[int]:
        self.asked.append(add_special_tokens)
        return [1] * add_special_tokens + [ord(c) for c in text]

    def apply_chat_template(self, messages: list, /, **options) -> str:
        return "".join(m["content"] for m in messages)


def _jobs() -> tuple[RequestJobs, _Tokenizer]:
    limits = SimpleNamespace(default_max_tokens=lambda n: 64 - n)
    engine = SimpleNamespace(
        max_model_len=64,
        info=SimpleNamespace(vocab_size=259),
        processor=SimpleNamespace(
            sampling_defaults={}, core_params=lambda p: p, checker=SimpleNamespace(limits=limits)
        ),
        check_request=lambda *args: None,
    )
    tokenizer = _Tokenizer()
    return RequestJobs(engine, tokenizer, "m"), tokenizer


def test_add_special_tokens_reaches_the_tokenizer_with_vllms_defaults():
    jobs, tokenizer = _jobs()
    messages = [{"role": "user", "content": "hi"}]
    cases = (
        (CompletionRequest(model="m", prompt="hi"), True),
        (CompletionRequest(model="m", prompt="hi", add_special_tokens=False), False),
        (ChatCompletionRequest(model="m", messages=messages), False),
        (ChatCompletionRequest(model="m", messages=messages, add_special_tokens=True), True),
    )
    for request, special in cases:
        make = jobs.completion_job if isinstance(request, CompletionRequest) else jobs.chat_job
        job = make(request)
        assert job.prompts[0][1] == [1] * special + [ord("h"), ord("i")], request
    assert tokenizer.asked == [True, False, False, True]
    for body, special in (
        ({"prompt": "hi"}, True),
        ({"messages": messages}, False),  # the template's special tokens alone, as vLLM's
        ({"messages": messages, "add_special_tokens": True}, True),
    ):
        assert jobs.tokenize(TokenizeRequest(**body))[:1] == ([1] if special else [104]), body


def _events(url: str, path: str, body: dict) -> list[dict]:
    reply = _post(url, path, {**body, "stream": True})
    assert reply.status_code == 200, reply.text
    return [json.loads(e[6:]) for e in reply.content.split(b"\n\n") if e[6:7] == b"{"]


def test_continuous_usage_stats_in_every_event(server):
    url, _ = server
    sampling = {"max_tokens": 5, "temperature": 0.0, "n": 2, "ignore_eos": True}
    options = {"include_usage": True, "continuous_usage_stats": True}
    messages = [{"role": "user", "content": "hi"}]
    chat_prompt = len(httpx.post(f"{url}/tokenize", json={"messages": messages}).json()["tokens"])
    for path, body, prompt_tokens in (
        ("/v1/completions", {"prompt": [PROMPT, PROMPT[:2]]}, [4, 4, 2, 2]),
        ("/v1/chat/completions", {"messages": messages}, [chat_prompt] * 2),
    ):
        events = _events(url, path, {**body, **sampling, "stream_options": options})
        *chunks, last = events
        assert last["choices"] == [] and last["usage"]["completion_tokens"] == 5 * len(
            prompt_tokens
        )
        seen: dict[int, int] = {}
        for chunk in chunks:
            (choice,) = chunk["choices"]
            usage, index = chunk["usage"], choice["index"]
            assert usage["prompt_tokens"] == prompt_tokens[index], path
            assert usage["completion_tokens"] >= seen.get(index, 0), path
            assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
            seen[index] = usage["completion_tokens"]
        assert seen == dict.fromkeys(range(len(prompt_tokens)), 5), path
        if path == "/v1/chat/completions":
            assert [c["usage"]["completion_tokens"] for c in chunks[:2]] == [0, 0]
        alone = {"include_usage": False, "continuous_usage_stats": True}
        quiet = _events(url, path, {**body, **sampling, "stream_options": alone})
        assert not any("usage" in event for event in quiet), path


def test_a_clients_request_id_names_the_reply(server):
    """vLLM's request_id: the reply's id is "cmpl-<id>" ("chatcmpl-<id>"), streamed too, and
    two requests giving the same id at once both run; a control character or an id past
    256 characters is refused."""
    url, _ = server
    body = {"prompt": PROMPT, "max_tokens": 3, "request_id": "trainer-7"}
    assert _post(url, "/v1/completions", body).json()["id"] == "cmpl-trainer-7"
    streamed = _events(url, "/v1/completions", body)
    assert {event["id"] for event in streamed} == {"cmpl-trainer-7"}
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "request_id": "x"}
    assert _post(url, "/v1/chat/completions", chat).json()["id"] == "chatcmpl-x"

    async def together() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=60) as client:
            slow = {**body, "max_tokens": 64, "ignore_eos": True}
            calls = [
                client.post(f"{url}/v1/completions", json={"model": "toy", **slow}) for _ in "abcd"
            ]
            return await asyncio.gather(*calls)

    replies = asyncio.run(together())
    assert [r.status_code for r in replies] == [200] * 4
    assert {r.json()["id"] for r in replies} == {"cmpl-trainer-7"}
    form = "1 to 256 printable characters"
    for bad, message in (
        ("", f"must be {form}"),
        ("a\nb", f"must be {form}"),
        ("a\u2028b", f"must be {form}"),  # a line separator
        ("x" * 257, f"must be {form}"),
        (7, f"must be a string (allowed: {form})"),
    ):
        refused = _post(url, "/v1/completions", {**body, "request_id": bad})
        assert refused.status_code == 400, bad
        assert refused.json()["error"] == {
            "message": f"request_id: {message}",
            "type": "invalid_request_error",
            "param": "request_id",
            "code": 400,
        }


def test_engine_ids_stay_unique_when_clients_reuse_a_request_id():
    """The engine's ids of a client's request_id carry a random part (two requests giving
    the same one both run); a generated id is unique already."""
    given = [request_ids("cmpl", "same") for _ in range(3)]
    assert {reply for reply, _ in given} == {"cmpl-same"}
    assert len({engine for _, engine in given}) == 3
    assert all(engine.startswith("cmpl-same-") for _, engine in given)
    reply, engine = request_ids("chatcmpl", None)
    assert reply == engine and reply.startswith("chatcmpl-")


def test_an_uncut_text_prompt_echoes_as_it_was_sent():
    """A text prompt of exactly truncate_prompt_tokens ids (its BOS counted) is not cut:
    it echoes as sent; one token fewer cuts its first character, its BOS kept."""
    jobs, _ = _jobs()
    jobs.tokenizer = Tokenizer(
        build_byte_tokenizer(), bos_token="<|endoftext|>", add_bos_token=True
    )
    body = {"model": "m", "prompt": "abc", "echo": True, "max_tokens": 0}
    whole = jobs.completion_job(CompletionRequest(**body, truncate_prompt_tokens=4))
    assert whole.prompts[0] == ("abc", jobs.tokenizer.encode("abc"))
    cut = jobs.completion_job(CompletionRequest(**body, truncate_prompt_tokens=3))
    bos = jobs.tokenizer.bos_token_id
    assert cut.prompts[0] == ("<|endoftext|>bc", [bos, *jobs.tokenizer.encode("bc", False)])
