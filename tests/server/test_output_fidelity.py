"""vLLM V1's outputs, offline and over HTTP alike: the EOS or stop id that ends a completion
stays in its token ids and out of its text unless include_stop_str_in_output, stop_reason
names what ended it, logprobs are Logprob objects ranked as the server orders its
top_logprobs, and completions' logprobs carry text offsets. The toy's text is noise: the
prompts are ones whose greedy run reaches EOS after a few tokens."""

from __future__ import annotations

import itertools
import json

import httpx
import pytest

from vllm_rlt import LLM, SamplingParams

EOS_AFTER_FIVE = [184, 257, 12, 130]  # greedy: 198 107 114 204 91, then <|endoftext|> (0)
SPACE_AT_3 = [3, 134, 206, 205]  # greedy: 6 56 14, then " " (35) ...
SPACE_AT_4 = [78, 134, 82, 197]  # greedy: 64 137 181 "m" (112) " " (35) "{" (126) ...

# name: (prompt, sampling, index of the token that ends it, stop_reason by include_stop)
CASES = {
    "eos": (EOS_AFTER_FIVE, {}, 5, (None, None)),
    "stop id": (SPACE_AT_3, {"stop_token_ids": [35]}, 3, (35, 35)),
    "special stop id": (EOS_AFTER_FIVE, {"stop_token_ids": [0], "ignore_eos": True}, 5, (0, 0)),
    "stop string": (SPACE_AT_4, {"stop": ["m {"]}, 5, ("m {", "m {")),
    "stop id first": (SPACE_AT_4, {"stop": ["{"], "stop_token_ids": [112]}, 3, (112, 112)),
    # The stop id completes the stop string: left out of the text, the string never shows;
    # kept, the string ends it (vLLM then reports the string).
    "stop string on a stop id": (
        SPACE_AT_4,
        {"stop": ["m "], "stop_token_ids": [35]},
        4,
        (35, "m "),
    ),
}
COMBINATIONS = list(itertools.product(CASES, [False, True], [True, False]))


@pytest.fixture(scope="module")
def llm():
    return LLM(model="toy")


def _sampling(name: str, include_stop: bool, skip_special: bool) -> dict:
    return {
        "max_tokens": 10,
        "temperature": 0.0,
        "include_stop_str_in_output": include_stop,
        "skip_special_tokens": skip_special,
        "spaces_between_special_tokens": False,  # the tokenizer's own decode, for comparison
        **CASES[name][1],
    }


def _expected_text(llm, name: str, include_stop: bool, skip_special: bool) -> str:
    """The greedy run's text up to the ending token, with that token only when kept; cut
    after a stop string, or before it when it is left out."""
    prompt, sampling, end, reasons = CASES[name]
    greedy = llm.generate([prompt], SamplingParams(max_tokens=10, temperature=0.0), use_tqdm=False)
    ids = greedy[0].outputs[0].token_ids
    reason = reasons[include_stop]
    kept = ids[: end + 1] if include_stop or isinstance(reason, str) else ids[:end]
    text = llm.get_tokenizer().decode(kept, skip_special_tokens=skip_special)
    if isinstance(reason, str):
        text = text[: text.index(reason) + (len(reason) if include_stop else 0)]
    return text


def _post(url: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", json={"model": "toy", **body}, timeout=60)


def _streamed(url: str, body: dict) -> list[dict]:
    """The choices of every event of a streamed completion."""
    reply = _post(url, {**body, "stream": True})
    assert reply.status_code == 200, reply.text
    events = [e for e in reply.content.split(b"\n\n") if e.startswith(b"data: {")]
    return [choice for e in events for choice in json.loads(e[len(b"data: ") :])["choices"]]


def test_stop_token_and_eos_text_equal_offline_and_over_http(server, llm):
    url, _ = server
    params = [SamplingParams(**_sampling(*combination)) for combination in COMBINATIONS]
    prompts = [CASES[name][0] for name, _, _ in COMBINATIONS]
    offline = llm.generate(prompts, params, use_tqdm=False)
    for combination, output in zip(COMBINATIONS, offline, strict=True):
        name, include_stop, skip_special = combination
        prompt, _, end, reasons = CASES[name]
        completion = output.outputs[0]
        text = _expected_text(llm, *combination)
        assert completion.text == text, combination
        assert completion.finish_reason == "stop" and completion.finished(), combination
        assert completion.stop_reason == reasons[include_stop], combination
        assert len(completion.token_ids) == end + 1, combination  # the ending token is kept
        body = {"prompt": prompt, **_sampling(*combination)}
        reply = _post(url, body).json()
        assert reply["choices"][0]["text"] == text, combination
        assert reply["choices"][0]["finish_reason"] == "stop", combination
        assert reply["usage"]["completion_tokens"] == end + 1, combination
        chunks = _streamed(url, body)
        assert "".join(chunk["text"] for chunk in chunks) == text, combination
        assert chunks[-1]["finish_reason"] == "stop", combination
    assert _expected_text(llm, "eos", True, False).endswith("<|endoftext|>")


def test_logprob_ranks_follow_the_servers_top_logprobs(server, llm):
    """Offline Logprobs: the sampled token first, its rank among all tokens, then the top
    alternatives ranked 1, 2, ... in the order and with the values the server lists them,
    their decoded_token the token's text."""
    url, _ = server
    prompt = [107, 104, 111, 114, 90]
    body = {"prompt": prompt, "max_tokens": 6, "temperature": 0.0, "logprobs": 3}
    served = _post(url, {**body, "ignore_eos": True}).json()["choices"][0]["logprobs"]
    params = SamplingParams(max_tokens=6, temperature=0.0, logprobs=3, ignore_eos=True)
    completion = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    tokenizer = llm.get_tokenizer()
    for index, (token, entry) in enumerate(
        zip(completion.token_ids, completion.logprobs, strict=True)
    ):
        assert next(iter(entry)) == token and entry[token].rank == 1  # greedy
        ranked = sorted(entry.items(), key=lambda item: item[1].rank)
        assert [logprob.rank for _, logprob in ranked] == [1, 2, 3]
        values = list(served["top_logprobs"][index].values())
        assert [logprob.logprob for _, logprob in ranked] == pytest.approx(values, abs=1e-5)
        assert served["token_logprobs"][index] == pytest.approx(entry[token].logprob, abs=1e-5)
        for top_token, logprob in ranked:
            assert logprob.decoded_token == tokenizer.decode([top_token], False)


def test_completion_top_logprobs_hold_the_sampled_token(server, llm):
    """vLLM's and OpenAI's legacy completions: each position's top_logprobs is the token
    itself first, then the top N (N + 1 entries where the token is not among them; logprobs 0
    gives the token alone), for sampled and echoed prompt tokens alike; chat's are the N most
    likely."""
    url, _ = server
    prompt = [107, 104, 111, 114, 90]
    sampled = {"max_tokens": 8, "temperature": 5.0, "seed": 3, "ignore_eos": True}
    for num in (0, 1):
        body = {"prompt": prompt, "logprobs": num, "echo": True, **sampled}
        served = _post(url, body).json()["choices"][0]["logprobs"]
        params = SamplingParams(logprobs=num, prompt_logprobs=num, **sampled)
        output = llm.generate([prompt], params, use_tqdm=False)[0]
        entries = output.prompt_logprobs[1:] + output.outputs[0].logprobs
        tokens = prompt[1:] + output.outputs[0].token_ids
        grew = 0
        for index, (token, entry) in enumerate(zip(tokens, entries, strict=True)):
            top = served["top_logprobs"][index + 1]
            values = [logprob.logprob for logprob in entry.values()]
            assert list(top.values()) == pytest.approx(values[: num + 1], abs=1e-5)
            assert len(top) == len(entry) <= num + 1 and values[0] == entry[token].logprob
            grew += len(top) == num + 1 and entry[token].rank > num
        assert grew > 0 or num == 0  # at 1: a token outside the top 1 is listed beside it
    chat = {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 2}
    reply = httpx.post(f"{url}/v1/chat/completions", json={"model": "toy", **chat, **sampled})
    for position in reply.json()["choices"][0]["logprobs"]["content"]:
        values = [top["logprob"] for top in position["top_logprobs"]]
        assert len(values) == 2 and values == sorted(values, reverse=True)


def test_completion_logprobs_carry_text_offsets(server):
    """OpenAI's and vLLM's text_offset: where each token's text begins, counted over the
    tokens' texts; streamed, from the length of the text sent before."""
    url, _ = server
    body = {"prompt": "offsets", "max_tokens": 6, "temperature": 0.0, "logprobs": 1}
    for echo in (False, True):
        logprobs = _post(url, {**body, "echo": echo}).json()["choices"][0]["logprobs"]
        offsets, tokens = logprobs["text_offset"], logprobs["tokens"]
        assert offsets == list(itertools.accumulate((len(t) for t in tokens[:-1]), initial=0))
    sent = 0
    for chunk in _streamed(url, body):
        if chunk["logprobs"] is not None and chunk["logprobs"]["tokens"]:
            assert chunk["logprobs"]["text_offset"][0] == sent
        sent += len(chunk["text"])


def test_echoed_token_ids_keep_their_special_tokens_and_offsets(server):
    """An echoed token-id prompt is decoded as vLLM decodes it, special tokens kept, so the
    prompt tokens' text offsets index into the text returned; /detokenize keeps them too."""
    url, _ = server
    body = {"prompt": [1, 100, 101], "echo": True, "max_tokens": 0, "logprobs": 0}
    for skip_special in (True, False):
        choice = _post(url, {**body, "skip_special_tokens": skip_special}).json()["choices"][0]
        assert choice["text"] == "<|im_start|>ab"
        logprobs = choice["logprobs"]
        starts = [choice["text"][i:] for i in logprobs["text_offset"]]
        assert all(s.startswith(t) for s, t in zip(starts, logprobs["tokens"], strict=True))
    detokenized = httpx.post(f"{url}/detokenize", json={"tokens": [1, 100, 2]}).json()
    assert detokenized["prompt"] == "<|im_start|>a<|im_end|>"


def test_choices_name_their_stop_reason(server):
    """vLLM's stop_reason in every choice, whole and streamed: the stop id or string that
    ended it, null for EOS or the length."""
    url, _ = server
    body = {"prompt": SPACE_AT_3, "max_tokens": 10, "temperature": 0.0}
    for sampling, reason in (({"stop_token_ids": [35]}, 35), ({}, None)):
        choice = _post(url, {**body, **sampling}).json()["choices"][0]
        assert choice["stop_reason"] == reason, sampling
        assert _streamed(url, {**body, **sampling})[-1]["stop_reason"] == reason, sampling
    prompt_only = {"prompt": SPACE_AT_3, "echo": True, "max_tokens": 0, "stop_token_ids": [6]}
    assert _post(url, prompt_only).json()["choices"][0]["stop_reason"] is None


def test_null_fields_take_their_defaults_as_vllm_does(server):
    """null in an optional field is as if it were left out: n 1, the sampling defaults, chat
    logprobs false; max_tokens null on /v1/completions runs up to the context (left out, 16);
    best_of may be null or n, and anything else is refused by name."""
    url, _ = server
    nulls = {f: None for f in ("n", "temperature", "top_p", "top_k", "min_p", "seed", "best_of")}
    body = {"prompt": EOS_AFTER_FIVE, "max_tokens": 4, "ignore_eos": True, **nulls}
    reply = _post(url, body)
    assert reply.status_code == 200, reply.text
    assert len(reply.json()["choices"]) == 1
    assert reply.json()["usage"]["completion_tokens"] == 4
    # greedy EOS after 24 tokens once 17 are forced: past the 16 a left-out max_tokens gives
    long = _post(url, {"prompt": EOS_AFTER_FIVE, "max_tokens": None, "min_tokens": 17})
    assert long.status_code == 200, long.text
    assert long.json()["usage"]["completion_tokens"] > 16
    assert long.json()["choices"][0]["finish_reason"] == "stop"
    assert _post(url, {"prompt": "x", "best_of": 1}).status_code == 200
    refused = _post(url, {"prompt": "x", "best_of": 2}).json()["error"]
    assert refused["param"] == "best_of" and "n (1)" in refused["message"]
    flags = {"prompt": "x", "max_tokens": 2, "temperature": 0.0}
    nulls = _post(url, {**flags, "stream": None, "echo": None})  # null: false, as in vLLM
    falses = _post(url, {**flags, "stream": False, "echo": False})
    assert nulls.status_code == 200, nulls.text
    assert nulls.json()["choices"][0]["text"] == falses.json()["choices"][0]["text"]
    chat = httpx.post(
        f"{url}/v1/chat/completions",
        json={"model": "toy", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
        | {"logprobs": None, "n": None, "top_logprobs": None},
        timeout=60,
    )
    assert chat.status_code == 200, chat.text
    assert chat.json()["choices"][0]["logprobs"] is None


def test_errors_name_the_prompt_and_the_logit_bias_entry(server):
    """Of several prompts, the empty one is named by its path; a logit_bias value out of
    range is named by its key."""
    url, _ = server
    empty = _post(url, {"prompt": [[5, 6], []], "max_tokens": 2}).json()["error"]
    assert empty["param"] == "prompt.1" and empty["message"].startswith("prompt.1: must contain")
    too_long = {"prompt": ["a", "b" * 4200], "max_tokens": 10}
    named = _post(url, too_long).json()["error"]
    assert named["param"] == "prompt.1" and "(4200 tokens) exceeds" in named["message"]
    too_many = _post(url, {"prompt": ["a", "b" * 4090], "max_tokens": 10}).json()["error"]
    assert too_many["param"] == "max_tokens"  # not the prompt's fault
    unset = _post(url, {"prompt": "a", "max_tokens": None, "min_tokens": 5000}).json()["error"]
    assert unset["param"] == "min_tokens" and "[0, 4095]" in unset["message"]
    for value, shown in ((101, "101.0"), (-100.5, "-100.5"), (float("nan"), "NaN")):
        body = {"prompt": "x", "logit_bias": {"7": 1, "5": value}}
        bias = httpx.post(
            f"{url}/v1/completions",
            content=json.dumps({"model": "toy", **body}),  # NaN as JSON's extension spells it
            headers={"content-type": "application/json"},
        ).json()["error"]
        assert bias["param"] == "logit_bias.5", value
        assert bias["message"] == f"logit_bias.5: must be in [-100.0, 100.0], got {shown}"


def test_chat_template_controls_as_vllm_takes_them(server, llm):
    """vLLM's add_generation_prompt, continue_final_message and chat_template_kwargs, on chat
    and on /tokenize: the prompt is the tokenizer's own rendering with them; a rendering
    argument among the kwargs, or both controls on, is a 400 naming the field."""
    url, _ = server
    tokenizer = llm.get_tokenizer()
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "The an"}]
    rendered = []
    for options in (
        {},
        {"add_generation_prompt": False},
        {"add_generation_prompt": False, "continue_final_message": True},
        {"chat_template_kwargs": {"enable_thinking": False}, "add_generation_prompt": None},
        {"chat_template_kwargs": {"add_generation_prompt": False}},  # overrides, as vLLM's
    ):
        body = {"model": "toy", "messages": messages, **options}
        served = httpx.post(f"{url}/tokenize", json=body).json()["tokens"]
        given = {k: v for k, v in options.items() if k != "chat_template_kwargs" and v is not None}
        flags = {"add_generation_prompt": True, **given}  # the server's default, as vLLM's
        flags |= options.get("chat_template_kwargs", {})
        want = tokenizer.apply_chat_template(messages, tokenize=False, **flags)
        assert served == tokenizer.encode(want, add_special_tokens=False), options
        chat = {**body, "max_tokens": 1, "temperature": 0.0}
        reply = httpx.post(f"{url}/v1/chat/completions", json=chat).json()
        assert reply["usage"]["prompt_tokens"] == len(served), options
        rendered.append(served)
    assert len({tuple(ids) for ids in rendered[:3]}) == 3 and rendered[3] == rendered[0]
    assert rendered[4] == rendered[1]
    for options, param in (
        ({"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs.tokenize"),
        ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs.messages"),
        ({"continue_final_message": True}, "continue_final_message"),
        ({"chat_template_kwargs": {"tools": "x"}}, "chat_template_kwargs.tools"),
        (
            {"chat_template_kwargs": {"add_generation_prompt": "no"}},
            "chat_template_kwargs.add_generation_prompt",
        ),
    ):
        body = {"model": "toy", "messages": messages, **options}
        for path in ("/tokenize", "/v1/chat/completions"):
            error = httpx.post(f"{url}{path}", json=body)
            assert error.status_code == 400, (options, error.text)
            assert error.json()["error"]["param"] == param, options
            assert error.json()["error"]["message"].startswith(f"{param}: "), options


def test_prompt_logprobs_as_vllm_returns_them(server, llm):
    """vLLM's prompt_logprobs: per choice on completions, once on chat; null for the first
    position, then token id -> logprob, rank and text, the engine's own; echo with
    logprobs returns them too; refused with a stream, as vLLM refuses it."""
    url, _ = server
    prompt = [107, 104, 111, 114, 90]
    body = {"prompt": prompt, "max_tokens": 2, "n": 2, "temperature": 1.0, "seed": 1}
    choices = _post(url, {**body, "prompt_logprobs": 2}).json()["choices"]
    params = SamplingParams(max_tokens=2, prompt_logprobs=2)
    want = llm.generate([prompt], params, use_tqdm=False)[0].prompt_logprobs
    assert choices[0]["prompt_logprobs"] == choices[1]["prompt_logprobs"]
    served = choices[0]["prompt_logprobs"]
    assert served[0] is None and len(served) == len(want) == len(prompt)
    for entry, expected in zip(served[1:], want[1:], strict=True):
        assert list(entry) == [str(token) for token in expected]
        for token, value in expected.items():
            got = entry[str(token)]
            assert got["logprob"] == pytest.approx(value.logprob, abs=1e-5)
            assert (got["rank"], got["decoded_token"]) == (value.rank, value.decoded_token)
    assert _post(url, body).json()["choices"][0]["prompt_logprobs"] is None
    echoed = {**body, "echo": True, "logprobs": 1, "max_tokens": 1}
    assert len(_post(url, echoed).json()["choices"][0]["prompt_logprobs"][1]) <= 2
    chat = {"model": "toy", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    reply = httpx.post(f"{url}/v1/chat/completions", json={**chat, "prompt_logprobs": 0}).json()
    scored = reply["prompt_logprobs"]
    assert scored[0] is None and len(scored) == reply["usage"]["prompt_tokens"]
    assert all(len(entry) == 1 for entry in scored[1:])
    refused = _post(url, {**body, "prompt_logprobs": 1, "stream": True})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "prompt_logprobs"
    assert _post(url, {**body, "prompt_logprobs": 0, "stream": True}).status_code == 200


def test_template_variables_reach_the_template():
    """chat_template_kwargs as the template sees them, and the fields they override; a name
    such as "self" is the caller's to give (Jinja keeps its own meaning)."""
    from vllm_rlt.entrypoints.openai.protocol import ChatCompletionRequest
    from vllm_rlt.tokenizer import Tokenizer, build_byte_tokenizer

    template = "{{ flavour }} {{ enable_thinking }} {{ add_generation_prompt }}"
    tokenizer = Tokenizer(build_byte_tokenizer(), chat_template=template)
    kwargs = {"self": 1, "flavour": 7, "enable_thinking": False, "add_generation_prompt": False}
    request = ChatCompletionRequest(
        model="toy", messages=[{"role": "user", "content": "hi"}], chat_template_kwargs=kwargs
    )
    messages = [{"role": "user", "content": "hi"}]
    assert tokenizer.apply_chat_template(messages, **request.template_options()) == "7 False False"


def _chat_events(url: str, body: dict) -> list[dict]:
    reply = httpx.post(f"{url}/v1/chat/completions", json={**body, "stream": True}, timeout=60)
    assert reply.status_code == 200, reply.text
    events = [e for e in reply.content.split(b"\n\n") if e.startswith(b"data: {")]
    return [json.loads(e[len(b"data: ") :])["choices"][0] for e in events]


def test_chat_echo_and_reply_role_as_vllm(server):
    """vLLM's chat `echo`: with the reply continuing the last message's role, each message (or
    stream, after its role event) starts with that message's text, parts joined with
    newlines; without a generation prompt the reply takes the last message's role."""
    url, _ = server
    user = {"role": "user", "content": "hi"}
    partial = {"role": "assistant", "content": [{"type": "text", "text": "The"}] * 2}
    continued = {"add_generation_prompt": False, "continue_final_message": True}
    for messages, options, role, lead in (
        ([user, partial], continued, "assistant", "The\nThe"),
        ([user, partial], {}, "assistant", "The\nThe"),  # a new assistant turn: still its role
        ([user], {}, "assistant", ""),  # the roles differ: nothing echoed
        ([user], {"add_generation_prompt": False}, "user", "hi"),
    ):
        body = {"model": "toy", "messages": messages, "max_tokens": 4, "temperature": 0.0, "n": 2}
        body |= options
        plain = httpx.post(f"{url}/v1/chat/completions", json=body).json()["choices"]
        echoed = httpx.post(f"{url}/v1/chat/completions", json={**body, "echo": True}).json()
        for was, now in zip(plain, echoed["choices"], strict=True):
            assert was["message"]["role"] == now["message"]["role"] == role, options
            assert now["message"]["content"] == lead + was["message"]["content"], options
        events = _chat_events(url, {**body, "echo": True})
        assert [e["delta"] for e in events[:2]] == [{"role": role, "content": ""}] * 2
        echo_events = [e["delta"] for e in events[2:4]] if lead else []
        assert echo_events == [{"content": lead}] * len(echo_events)
        for choice in (0, 1):
            text = "".join(e["delta"].get("content", "") for e in events if e["index"] == choice)
            assert text == echoed["choices"][choice]["message"]["content"], options
    refused = httpx.post(f"{url}/v1/chat/completions", json={**body, "echo": "yes"})
    assert refused.status_code == 400
    assert refused.json()["error"]["message"].startswith("echo: must be true or false")


def test_token_ids_in_replies_as_vllm_returns_them(server):
    """vLLM's return_token_ids: a completion choice holds its prompt's and its own ids, a chat
    reply the prompt's once and each choice its own; streamed, the prompt's come with each
    choice's first event (chat: its role event) and every event holds its new ids.
    return_tokens_as_token_ids names logprob tokens `token_id:N`."""
    url, _ = server
    prompt = EOS_AFTER_FIVE
    base = {"max_tokens": 4, "temperature": 0.0, "n": 2, "return_token_ids": True}
    messages = [{"role": "user", "content": "hi"}]
    chat_prompt = httpx.post(f"{url}/tokenize", json={"messages": messages}).json()["tokens"]
    for kind, body in (
        ("completion", {"prompt": prompt, **base}),
        ("chat", {"messages": messages, **base}),
    ):
        path = "/v1/completions" if kind == "completion" else "/v1/chat/completions"
        whole = httpx.post(f"{url}{path}", json={"model": "toy", **body}).json()
        plain = httpx.post(f"{url}{path}", json={"model": "toy", **body, "return_token_ids": None})
        assert "token_ids" not in plain.json()["choices"][0]
        ids = [choice["token_ids"] for choice in whole["choices"]]
        assert [len(i) for i in ids] == [4, 4] and ids[0] == ids[1], kind
        if kind == "completion":
            assert [c["prompt_token_ids"] for c in whole["choices"]] == [prompt] * 2
        else:
            assert whole["prompt_token_ids"] == chat_prompt
        stream = {"model": "toy", **body, "stream": True}
        reply = httpx.post(f"{url}{path}", json=stream, timeout=60)
        events = [json.loads(e[6:]) for e in reply.content.split(b"\n\n") if e[6:7] == b"{"]
        for index in (0, 1):
            mine = [e for e in events if e["choices"][0]["index"] == index]
            got = [t for e in mine for t in e["choices"][0].get("token_ids", [])]
            assert got == ids[index], kind
            if kind == "completion":
                firsts = [e["choices"][0].get("prompt_token_ids") for e in mine]
                assert firsts[0] == prompt and not any(firsts[1:]), kind
            else:
                assert mine[0]["prompt_token_ids"] == chat_prompt
                assert mine[0]["choices"][0]["delta"]["role"] == "assistant"
                assert not any("prompt_token_ids" in e for e in mine[1:])
    named = {"max_tokens": 3, "temperature": 0.0, "return_tokens_as_token_ids": True}
    completion = _post(url, {"prompt": prompt, "logprobs": 2, "return_token_ids": True, **named})
    choice = completion.json()["choices"][0]
    assert choice["logprobs"]["tokens"] == [f"token_id:{t}" for t in choice["token_ids"]]
    for top in choice["logprobs"]["top_logprobs"]:
        assert top and all(key.startswith("token_id:") for key in top)
    chat = {"model": "toy", "messages": messages, "logprobs": True, "top_logprobs": 2, **named}
    content = httpx.post(f"{url}/v1/chat/completions", json=chat).json()["choices"][0]
    for entry in content["logprobs"]["content"]:
        for shown in [entry, *entry["top_logprobs"]]:
            assert shown["token"].startswith("token_id:")
            assert shown["bytes"] == list(shown["token"].encode())
