"""vLLM's input side: SamplingParams' vLLM values (top_k -1, max_tokens None,
truncate_prompt_tokens, best_of, logits_processors), vllm_rlt.inputs' prompt dicts,
`LLM.chat`'s keyword arguments, and the Hugging Face tokenizer `get_tokenizer()` returns
(or the subset of it without transformers)."""

from __future__ import annotations

import asyncio
import sys

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

import vllm_rlt
from vllm_rlt import LLM, SamplingParams
from vllm_rlt.config import ParamError
from vllm_rlt.engine.engine_args import EngineArgs
from vllm_rlt.inputs import TextPrompt, TokensPrompt
from vllm_rlt.tokenizer import Tokenizer
from vllm_rlt.tokenizer.hf_compat import CompatTokenizer, user_tokenizer

TEXTS = ["347+589=", " héllo wörld, 日本語 🙂", "a<|im_end|>b<|im_start|>", ""]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+1="}]
GREEDY = SamplingParams(temperature=0.0, max_tokens=4)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(model="ouro-tasks", dtype="float32", max_model_len=64)


@pytest.fixture(scope="module")
def bpe_folder(tmp_path_factory) -> str:
    """A model folder with a trained BPE tokenizer.json, BOS added by tokenizer_config.json,
    pad and unk tokens and a chat template."""
    backend = HFTokenizer(models.BPE(unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=350,
        special_tokens=["<unk>", "<s>", "</s>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    backend.train_from_iterator(["the quick brown fox, héllo wörld 日本語"] * 5, trainer=trainer)
    template = "{{ bos_token }}{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
    tokenizer = Tokenizer(
        backend,
        chat_template=template,
        bos_token="<s>",
        eos_token="</s>",
        add_bos_token=True,
        pad_token="<pad>",
        unk_token="<unk>",
    )
    folder = tmp_path_factory.mktemp("bpe")
    tokenizer.save_pretrained(folder)
    return str(folder)


@pytest.fixture
def without_transformers(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # its import raises ImportError


# SamplingParams


def test_top_k_minus_one_and_max_tokens_none_are_vllms_values() -> None:
    assert SamplingParams(top_k=-1).top_k == 0 == SamplingParams(top_k=0).top_k
    assert SamplingParams(max_tokens=None, min_tokens=3).max_tokens is None
    with pytest.raises(ParamError, match=r"top_k must be 0 or -1 \(every token\)") as caught:
        SamplingParams(top_k=-2)
    assert caught.value.param == "top_k"


@pytest.mark.parametrize(
    ("kwargs", "param", "match"),
    [
        ({"best_of": 2}, "best_of", "best_of is not supported"),
        ({"n": 2, "best_of": 3}, "best_of", r"leave it unset \(None; null over HTTP\) or equal"),
        ({"logits_processors": [lambda ids, x: x]}, "logits_processors", "not supported"),
        ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens", r">= 1"),
        ({"truncate_prompt_tokens": -2}, "truncate_prompt_tokens", r">= 1"),
        ({"use_beam_search": True}, "use_beam_search", "SamplingParams.. got the argument"),
        ({"max_token": 5}, "max_token", "which this engine does not support"),
    ],
)
def test_unsupported_sampling_arguments_are_named(kwargs, param, match) -> None:
    with pytest.raises(ParamError, match=match) as caught:
        SamplingParams(**kwargs)
    assert caught.value.param == param


def test_vllm_defaults_of_unsupported_fields_are_accepted() -> None:
    params = SamplingParams(n=3, best_of=3, logits_processors=[])
    assert params.best_of is None and params.logits_processors is None


def test_max_tokens_none_runs_up_to_the_context(llm: LLM) -> None:
    ids = llm.get_tokenizer().encode("347+589=")
    params = SamplingParams(max_tokens=None, ignore_eos=True, temperature=0.0)
    out = llm.generate(TokensPrompt(prompt_token_ids=ids), params, use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 64 - len(ids)
    assert out.outputs[0].finish_reason == "length"


def test_truncate_prompt_tokens_keeps_the_last_tokens(llm: LLM) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=4, truncate_prompt_tokens=8)
    out = llm.generate("noise 12 347+589=", params, use_tqdm=False)[0]
    assert out.prompt_token_ids == llm.get_tokenizer().encode("347+589=")
    assert out.outputs[0].text == "936"
    whole = SamplingParams(max_tokens=1, truncate_prompt_tokens=-1)  # -1: max_model_len
    with pytest.raises(ParamError, match=r"the prompt \(64 tokens\) fills the context length"):
        llm.generate([[5] * 70], whole, use_tqdm=False)
    with pytest.raises(ParamError, match=r"truncate_prompt_tokens \(65\) is greater") as caught:
        llm.generate("x", SamplingParams(truncate_prompt_tokens=65), use_tqdm=False)
    assert caught.value.param == "truncate_prompt_tokens"


def test_async_llm_resolves_max_tokens_none_too() -> None:
    from vllm_rlt.engine.async_llm import AsyncLLM

    engine = AsyncLLM.from_engine_args(EngineArgs(model="toy", max_model_len=32), in_process=True)

    async def run() -> list[int]:
        params = SamplingParams(max_tokens=None, ignore_eos=True, truncate_prompt_tokens=4)
        async for output in engine.generate([5, 6, 7, 8, 9, 10], params, "r"):
            final = output
        assert final.prompt_token_ids == [7, 8, 9, 10]
        return final.outputs[0].token_ids

    try:
        assert len(asyncio.run(run())) == 32 - 4
    finally:
        engine.shutdown()


def test_async_llm_tokenizes_a_long_text_off_the_event_loop(monkeypatch) -> None:
    """A text past GIL_FREE_CHARS is encoded on a worker thread with the GIL released, so the
    event loop goes on serving other requests meanwhile; a short one on the loop."""
    import threading

    from vllm_rlt.engine.async_llm import AsyncLLM
    from vllm_rlt.tokenizer import Tokenizer
    from vllm_rlt.tokenizer.tokenizer import GIL_FREE_CHARS

    engine = AsyncLLM.from_engine_args(EngineArgs(model="ouro-tasks"), in_process=True)
    long = "1+1=" * (GIL_FREE_CHARS // 4 + 1)
    calls: dict[str, tuple[bool, int]] = {}
    encode = Tokenizer.encode

    def spied(self, text, add_special_tokens=True, release_gil=False):
        if text in (long, "1+1="):
            calls[text] = (release_gil, threading.get_ident())
        return encode(self, text, add_special_tokens, release_gil)

    monkeypatch.setattr(Tokenizer, "encode", spied)

    async def run() -> int:
        with pytest.raises(ParamError, match="context length"):
            async for _ in engine.generate(long, GREEDY, "long"):
                pass
        async for _ in engine.generate("1+1=", GREEDY, "short"):
            pass
        for bad in ({"prompt": None, "prompt_token_ids": None}, {"prompt": 5}):
            with pytest.raises(ParamError, match="prompt"):  # not a TypeError from len()
                async for _ in engine.generate(bad, GREEDY, "bad"):
                    pass
        return threading.get_ident()

    try:
        loop_thread = asyncio.run(run())
    finally:
        engine.shutdown()
    assert calls[long][0] and calls[long][1] != loop_thread
    assert calls["1+1="] == (False, loop_thread)


def test_async_llm_refuses_what_its_engine_core_could_not_read() -> None:
    """A library caller's bad request id, abort arguments, prompt ids or a SamplingParams
    edited after it was made are a ParamError naming the field, checked before anything
    is sent: each of them, sent as it was, stopped the engine core process (a message it
    could not decode), failing every request. The core itself now drops such a message
    and serves on, and a request that cannot be sent leaves nothing registered."""
    from vllm_rlt.engine.async_llm import AsyncLLM
    from vllm_rlt.engine.process.messages import AbortRequest

    engine = AsyncLLM.from_engine_args(EngineArgs(model="ouro-tasks", max_model_len=64))
    greedy = SamplingParams(max_tokens=4, temperature=0.0)

    def edited(**changes) -> SamplingParams:
        params = SamplingParams(max_tokens=4)
        for name, value in changes.items():
            setattr(params, name, value)
        return params

    async def text(prompt, params, request_id) -> str:
        async for output in engine.generate(prompt, params, request_id):
            last = output
        return last.outputs[0].text

    async def run() -> None:
        bad = [
            ("347+589=", greedy, 5, "request_id"),
            ("347+589=", greedy, "\ud800", "request_id"),
            ([True], greedy, "a", "prompt"),
            ([2**70], greedy, "b", "prompt"),
            ("1+1=", edited(temperature="hot"), "c", "temperature"),
            ("1+1=", edited(n=0), "d", "n"),
            ("1+1=", edited(stop_token_ids=[True]), "e", "stop_token_ids"),
            ("1+1=", edited(logit_bias={"5": 1.0}), "f", "logit_bias"),
        ]
        for prompt, params, request_id, field in bad:
            with pytest.raises(ParamError) as caught:
                await text(prompt, params, request_id)
            assert caught.value.param == field
        for args, field in (((5,), "request_id"), (("x", "a"), "index"), (("x", 2**70), "index")):
            with pytest.raises(ParamError) as caught:
                engine.abort(*args)
            assert caught.value.param == field
        engine.client.send(AbortRequest(5, None))  # type: ignore[arg-type]  # bypassing checks
        assert await text("347+589=", greedy, "after") == "936"

        def unsendable(command) -> None:
            raise OverflowError("int too big to convert")

        send, engine.client.send = engine.client.send, unsendable
        with pytest.raises(ParamError, match="could not be sent"):
            await text("1+1=", SamplingParams(max_tokens=4, n=3), "lost")
        engine.client.send = send
        assert (engine.num_requests, engine.num_sequences) == (0, 0)
        assert await text("347+589=", greedy, "lost") == "936"  # its id is free again

    try:
        asyncio.run(run())
    finally:
        engine.shutdown()


def test_async_llms_one_after_another_on_one_event_loop() -> None:
    """An engine shut down on the event loop takes its output reader off the loop before
    its sockets close: the next engine on that loop got the same descriptor number, and
    its first generate waited forever on the stale registration."""
    from vllm_rlt.engine.async_llm import AsyncLLM

    async def once() -> str:
        engine = AsyncLLM.from_engine_args(EngineArgs(model="ouro-tasks", max_model_len=64))
        try:
            async for output in engine.generate("347+589=", GREEDY, "r"):
                last = output
        finally:
            engine.shutdown()
        return last.outputs[0].text

    async def run() -> list[str]:
        return [await asyncio.wait_for(once(), 60) for _ in range(3)]

    assert asyncio.run(run()) == ["936"] * 3


def test_async_llm_generate_takes_vllms_arguments_and_prompt_forms() -> None:
    """vLLM's `generate(prompt, sampling_params, request_id)`, positional or by keyword, with
    a text, token ids, a TextPrompt or a TokensPrompt: each form of one prompt gives the same
    tokens, and a text is tokenized as `LLM` tokenizes it."""
    from vllm_rlt.engine.async_llm import AsyncLLM

    engine = AsyncLLM.from_engine_args(EngineArgs(model="ouro-tasks"), in_process=True)
    ids = engine.tokenizer.encode("347+589=")

    async def final(**call) -> object:
        async for output in engine.generate(**call):
            last = output
        return last

    async def run() -> None:
        forms = {
            "text": "347+589=",
            "ids": ids,
            "text_prompt": TextPrompt(prompt="347+589="),
            "tokens_prompt": TokensPrompt(prompt_token_ids=ids),
        }
        outputs = {
            name: await final(prompt=form, sampling_params=GREEDY, request_id=name)
            for name, form in forms.items()
        }
        assert {name: out.prompt_token_ids for name, out in outputs.items()} == dict.fromkeys(
            forms, ids
        )
        assert len({tuple(out.outputs[0].token_ids) for out in outputs.values()}) == 1
        assert outputs["text"].prompt == "347+589="
        with pytest.raises(ParamError) as caught:
            await final(
                prompt={"prompt": "x", "cache_salt": "s"}, sampling_params=GREEDY, request_id="bad"
            )
        assert caught.value.param == "cache_salt"

    try:
        asyncio.run(run())
        stats = engine.engine_stats()
        assert not stats.has_unfinished and stats.all_blocks_free
    finally:
        engine.shutdown()


# Prompt dicts


def test_text_and_tokens_prompts(llm: LLM) -> None:
    assert (vllm_rlt.TextPrompt, vllm_rlt.TokensPrompt) == (TextPrompt, TokensPrompt)
    ids = llm.get_tokenizer().encode("347+589=")
    prompts = [
        TextPrompt(prompt="347+589="),
        TokensPrompt(prompt_token_ids=ids),
        TokensPrompt(prompt_token_ids=ids, prompt="shown"),
    ]
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].text for o in outs] == ["936"] * 3
    assert [o.prompt for o in outs] == ["347+589=", None, "shown"]
    with pytest.raises(ParamError, match="'multi_modal_data', which is not supported") as caught:
        llm.generate([TextPrompt(prompt="1"), {"prompt": "2", "multi_modal_data": {}}])
    assert caught.value.param == "multi_modal_data"


# LLM.chat


def test_chat_takes_vllms_template_arguments(llm: LLM) -> None:
    template = (
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
        "{% if tools %}tools={{ tools | length }}{% endif %}{{ suffix | default('') }}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    tools = [{"type": "function", "function": {"name": "add"}}]
    kwargs = {"chat_template_kwargs": {"suffix": "!"}, "use_tqdm": False}
    out = llm.chat(CHAT, GREEDY, chat_template=template, tools=tools, **kwargs)[0]
    assert out.prompt == "<system>Be brief.<user>1+1=tools=1!<assistant>"
    unprompted = {"chat_template_kwargs": {"add_generation_prompt": False}, "use_tqdm": False}
    out = llm.chat(CHAT, GREEDY, chat_template=template, **unprompted)[0]
    assert out.prompt == "<system>Be brief.<user>1+1="
    assistant = [*CHAT, {"role": "assistant", "content": "The answer is"}]
    out = llm.chat(
        assistant,
        GREEDY,
        chat_template=template + "<end>",
        add_generation_prompt=False,
        continue_final_message=True,
        use_tqdm=False,
    )[0]
    assert out.prompt == "<system>Be brief.<user>1+1=<assistant>The answer is"


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"lora_request": object()}, "lora_request"),
        ({"mm_processor_kwargs": {}}, "mm_processor_kwargs"),
        ({"chat_template_content_format": "openai"}, "chat_template_content_format"),
        ({"chat_template_kwargs": {"tokenize": False}}, "tokenize"),
        ({"continue_final_message": True}, "continue_final_message"),
    ],
)
def test_chat_refuses_what_it_cannot_honour(llm: LLM, kwargs, param) -> None:
    with pytest.raises(ParamError) as caught:
        llm.chat(CHAT, GREEDY, use_tqdm=False, **kwargs)
    assert caught.value.param == param


def test_engine_template_keeps_tokenization_arguments_out() -> None:
    tokenizer = Tokenizer.byte_level(chat_template="{{ tokenize | default('absent') }}")
    assert tokenizer.apply_chat_template(CHAT) == "absent"
    with pytest.raises(ParamError, match="not a template variable") as caught:
        tokenizer.apply_chat_template(CHAT, tokenize=True)
    assert caught.value.param == "tokenize"


# get_tokenizer


def test_get_tokenizer_is_hugging_faces(llm: LLM) -> None:
    transformers = pytest.importorskip("transformers")
    tok = llm.get_tokenizer()
    assert isinstance(tok, transformers.PreTrainedTokenizerFast) and tok is llm.get_tokenizer()
    engine = llm.tokenizer
    assert (tok.eos_token_id, tok.pad_token_id, tok.bos_token_id) == (2, None, None)
    assert len(tok) == engine.vocab_size and tok.chat_template == engine.chat_template
    for text in TEXTS:
        ids = engine.encode(text)
        assert tok.encode(text) == ids == tok(text)["input_ids"]
        for skip in (False, True):
            assert tok.decode(ids, skip_special_tokens=skip) == engine.decode(ids, skip)
    rendered = engine.apply_chat_template(CHAT, add_generation_prompt=True)
    assert tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False) == rendered
    stop = SamplingParams(stop_token_ids=[tok.eos_token_id], temperature=0.0, max_tokens=8)
    assert llm.generate("347+589=", stop, use_tqdm=False)[0].outputs[0].text == "936"


def test_hugging_faces_tokenizer_over_a_model_folder(bpe_folder: str) -> None:
    pytest.importorskip("transformers")
    engine = Tokenizer.from_pretrained(bpe_folder)
    tok = user_tokenizer(engine)
    assert (tok.bos_token, tok.eos_token, tok.pad_token, tok.unk_token) == (
        "<s>",
        "</s>",
        "<pad>",
        "<unk>",
    )
    assert (tok.pad_token_id, tok.eos_token_id) == (3, 2)
    for text in TEXTS[:2] + ["the quick brown fox"]:
        ids = engine.encode(text)
        assert ids[0] == engine.bos_token_id and tok.encode(text) == ids
        assert tok.encode(text, add_special_tokens=False) == ids[1:]
        assert tok.decode(ids, skip_special_tokens=True) == engine.decode(ids)
    rendered = tok.apply_chat_template(CHAT, tokenize=False)
    assert rendered == engine.apply_chat_template(CHAT, add_generation_prompt=False)
    assert engine.encode("x")[:1] == [1]  # the engine's backend is left as it was


def test_without_transformers_a_compatible_subset(
    llm: LLM, bpe_folder: str, without_transformers
) -> None:
    engine = Tokenizer.from_pretrained(bpe_folder)
    tok = user_tokenizer(engine)
    assert isinstance(tok, CompatTokenizer)
    assert (tok.eos_token_id, tok.pad_token_id, tok.bos_token_id, tok.unk_token_id) == (2, 3, 1, 0)
    assert len(tok) == engine.vocab_size and tok.vocab_size <= len(tok)
    ids = engine.encode("the quick")
    assert tok("the quick") == {"input_ids": ids, "attention_mask": [1] * len(ids)}
    assert tok(["the", "fox"])["input_ids"] == [engine.encode("the"), engine.encode("fox")]
    assert tok.decode(ids) == engine.decode(ids, skip_special_tokens=False)
    assert tok.batch_decode([ids, ids[1:]], skip_special_tokens=True) == ["the quick"] * 2
    assert tok.convert_ids_to_tokens(ids[:1]) == ["<s>"] and tok.convert_ids_to_tokens(1) == "<s>"
    assert tok.convert_ids_to_tokens(10**6) is None
    text = engine.apply_chat_template(CHAT, add_generation_prompt=False)
    assert tok.apply_chat_template(CHAT) == engine.encode(text, add_special_tokens=False)
    assert tok.apply_chat_template(CHAT, tokenize=False) == text
    batch = tok.apply_chat_template([CHAT, CHAT], return_dict=True)
    assert batch["input_ids"] == [engine.encode(text, add_special_tokens=False)] * 2
    with pytest.raises(ParamError, match="install transformers") as caught:
        tok("the", return_tensors="pt")
    assert caught.value.param == "return_tensors"
    built_in = LLM.get_tokenizer(_fresh(llm))
    assert isinstance(built_in, CompatTokenizer) and built_in.pad_token_id is None
    assert built_in.eos_token_id == 2 and built_in.encode("347+589=") == llm.tokenizer.encode(
        "347+589="
    )


def _fresh(llm: LLM) -> LLM:
    """The same engine without the tokenizer `get_tokenizer` made before."""
    copy = object.__new__(LLM)
    copy.__dict__.update(llm.__dict__, _user_tokenizer=None)
    return copy


def test_a_cut_text_prompt_keeps_its_bos_offline_as_over_http() -> None:
    """truncate_prompt_tokens on a text prompt keeps the BOS its encoding adds, in the
    engine's own encoding (LLM, AsyncLLM.generate) as in the server's."""
    from types import SimpleNamespace

    from vllm_rlt.engine.input_processor import InputProcessor
    from vllm_rlt.tokenizer import build_byte_tokenizer

    tokenizer = Tokenizer(build_byte_tokenizer(), bos_token="<|endoftext|>", add_bos_token=True)
    checker = SimpleNamespace(limits=SimpleNamespace(max_model_len=5))
    processor = InputProcessor(tokenizer, checker, {})  # type: ignore[arg-type]
    bos = tokenizer.bos_token_id
    assert processor.encode("abcdef", truncate_prompt_tokens=3) == [
        bos,
        *tokenizer.encode("ef", False),
    ]
    assert processor.encode("abcdef", True, 3) == processor.encode("abcdef", False, 3)
    assert processor.encode("abcdef", truncate_prompt_tokens=-1)[:1] == [bos]  # the context: 5
    assert len(processor.encode("abcdef", truncate_prompt_tokens=-1)) == 5
    assert processor.encode("ab", truncate_prompt_tokens=3) == tokenizer.encode("ab")
