"""Tokenizer package: byte tokenizer ids, HF folder round trip, chat templates, streaming."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from vllm_rlt.config import ParamError
from vllm_rlt.tokenizer import IncrementalDetokenizer, Tokenizer, build_byte_tokenizer
from vllm_rlt.tokenizer.byte_level import (
    BYTE_VOCAB_SIZE,
    ENDOFTEXT_ID,
    IM_END_ID,
    IM_START_ID,
)
from vllm_rlt.tokenizer.tokenizer import CHATML_TEMPLATE

MULTIBYTE = "héllo wörld, 日本語 🙂 ok"
CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi é"},
]


def byte_ids(text: str) -> list[int]:
    return [3 + b for b in text.encode("utf-8")]


def write_folder(
    folder: Path, config: dict | None = None, files: dict[str, str] | None = None
) -> Path:
    """A model folder with the byte tokenizer, an optional tokenizer_config.json and files."""
    folder.mkdir(parents=True, exist_ok=True)
    build_byte_tokenizer().save(str(folder / "tokenizer.json"))
    if config is not None:
        (folder / "tokenizer_config.json").write_text(json.dumps(config))
    for name, text in (files or {}).items():
        (folder / name).write_text(text, encoding="utf-8")
    return folder


def stream(detok: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    return [detok.add(token_id) for token_id in ids] + [detok.flush()]


# Byte tokenizer


@pytest.mark.parametrize("text", ["Hello, world!", "é", "日本", "🙂", MULTIBYTE, " \n\t "])
def test_byte_tokenizer_one_id_per_byte(text: str) -> None:
    tok = build_byte_tokenizer()
    assert tok.get_vocab_size(with_added_tokens=True) == BYTE_VOCAB_SIZE == 259
    ids = tok.encode(text).ids
    assert ids == byte_ids(text)
    assert tok.decode(ids) == text


def test_byte_tokenizer_matches_bytelevel_pretokenizer_for_every_byte() -> None:
    """The rebuilt byte table agrees with the library on every byte valid UTF-8 can hold."""
    codes = [*range(0x801), *range(0x1000, 0x10000, 0x1000)]  # 1-3 byte leads
    codes += [*range(0x10000, 0x110000, 0x40000), 0x10FFFF]  # 4-byte leads
    text = "".join(map(chr, codes))
    never_in_utf8 = {0xC0, 0xC1, *range(0xF5, 0x100)}
    assert set(text.encode("utf-8")) == set(range(256)) - never_in_utf8
    tok = build_byte_tokenizer()
    pieces = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    (chars, _), *_ = pieces.pre_tokenize_str(text)
    assert tok.encode(text).tokens == list(chars)
    assert tok.encode(text).ids == byte_ids(text)


def test_byte_tokenizer_special_tokens() -> None:
    tok = Tokenizer.byte_level()
    text = "<|im_start|>user\nhi<|im_end|><|endoftext|>"
    ids = tok.encode(text)
    assert ids == [IM_START_ID, *byte_ids("user\nhi"), IM_END_ID, ENDOFTEXT_ID]
    assert tok.decode(ids, skip_special_tokens=False) == text
    assert tok.decode(ids) == "user\nhi"
    assert tok.convert_ids_to_tokens([IM_END_ID, 3 + ord("a")]) == ["<|im_end|>", "a"]
    with pytest.raises(ValueError, match="token id 259"):
        tok.convert_ids_to_tokens([259])


def test_byte_level_tokenizer_settings() -> None:
    tok = Tokenizer.byte_level()
    assert tok.vocab_size == 259
    assert tok.eos_token_ids == frozenset({ENDOFTEXT_ID, IM_END_ID})
    assert tok.bos_token_id is None
    assert tok.encode("a") == [3 + ord("a")]
    assert tok.chat_template == CHATML_TEMPLATE


# HF folder loading and saving


def test_save_and_load_round_trip(tmp_path: Path) -> None:
    tok = Tokenizer.byte_level()
    tok.save_pretrained(tmp_path / "model")
    loaded = Tokenizer.from_pretrained(tmp_path / "model")
    text = "<|im_start|>" + MULTIBYTE + "<|im_end|>"
    assert loaded.encode(text) == tok.encode(text)
    assert loaded.vocab_size == tok.vocab_size
    assert loaded.eos_token_ids == tok.eos_token_ids == frozenset({0, 2})
    assert loaded.bos_token_id is None
    assert loaded.chat_template == tok.chat_template
    assert loaded.apply_chat_template(CHAT) == tok.apply_chat_template(CHAT)


def test_round_trip_keeps_bos_and_added_tokens(tmp_path: Path) -> None:
    config = {
        "bos_token": {"content": "<|endoftext|>", "special": True},
        "eos_token": "<|im_end|>",
        "add_bos_token": True,
        "added_tokens_decoder": {
            "259": {"content": "<think>", "special": False},
            "260": {"content": "<pad>", "special": True},
        },
    }
    tok = Tokenizer.from_pretrained(write_folder(tmp_path / "a", config))
    assert tok.vocab_size == 261
    assert tok.bos_token_id == ENDOFTEXT_ID
    assert tok.eos_token_ids == frozenset({IM_END_ID})
    assert tok.encode("<think>a<pad>") == [ENDOFTEXT_ID, 259, 3 + ord("a"), 260]
    assert tok.encode("a", add_special_tokens=False) == [3 + ord("a")]
    assert tok.decode([259, 260]) == "<think>"
    tok.save_pretrained(tmp_path / "b")
    loaded = Tokenizer.from_pretrained(tmp_path / "b")
    assert loaded.encode("<think>a<pad>") == tok.encode("<think>a<pad>")
    assert (loaded.vocab_size, loaded.bos_token_id) == (261, ENDOFTEXT_ID)
    assert loaded.eos_token_ids == tok.eos_token_ids
    assert loaded.chat_template == CHATML_TEMPLATE


def test_left_truncation_drops_the_texts_first_tokens_and_keeps_special_ones(
    tmp_path: Path,
) -> None:
    """A prompt cut to its last N ids as transformers truncates one on the left: the
    special tokens encoding adds (a config's BOS, a post-processor's BOS and EOS) stay."""
    config = {"add_bos_token": True, "bos_token": "<|endoftext|>"}
    with_bos = Tokenizer.from_pretrained(write_folder(tmp_path, config))
    text = "abcdef"

    def cut(tokenizer: Tokenizer, keep: int, special: bool = True, gil_free: bool = False):
        ids = tokenizer.encode(text, special)
        return tokenizer.left_truncated(text, ids, keep, special, gil_free)

    assert cut(with_bos, 3) == [ENDOFTEXT_ID, *byte_ids("ef")]
    assert cut(with_bos, 3, special=False) == byte_ids("def")
    assert cut(with_bos, 1) == byte_ids("f")  # no room for the BOS
    assert cut(with_bos, 7) == with_bos.encode(text)
    backend = build_byte_tokenizer()
    backend.post_processor = processors.TemplateProcessing(
        single="<|im_start|> $A <|im_end|>",
        special_tokens=[("<|im_start|>", IM_START_ID), ("<|im_end|>", IM_END_ID)],
    )
    wrapped = Tokenizer(backend)
    assert cut(wrapped, 4) == [IM_START_ID, *byte_ids("ef"), IM_END_ID]
    assert cut(wrapped, 4, gil_free=True) == cut(wrapped, 4)


def test_generation_config_eos_ids(tmp_path: Path) -> None:
    folder = write_folder(
        tmp_path,
        {"eos_token": "<|im_end|>"},
        {"generation_config.json": json.dumps({"eos_token_id": [0, 2]})},
    )
    assert Tokenizer.from_pretrained(folder).eos_token_ids == frozenset({0, 2})
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": 1}))
    assert Tokenizer.from_pretrained(folder).eos_token_ids == frozenset({1, 2})


def test_missing_or_bad_tokenizer_file(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.from_pretrained(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match="tokenizer.json"):
        Tokenizer.from_pretrained(tmp_path)


@pytest.mark.parametrize(
    ("config", "match"),
    [
        ({"eos_token": "<nope>"}, "eos_token '<nope>' is not in the vocabulary"),
        ({"bos_token": 5}, "bos_token must be a string"),
        ({"chat_template": [{"name": "tool_use", "template": "x"}]}, "no 'default'"),
        ({"added_tokens_decoder": {"300": {"content": "<x>"}}}, "id 300"),
    ],
)
def test_bad_tokenizer_config(tmp_path: Path, config: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        Tokenizer.from_pretrained(write_folder(tmp_path, config))


# Chat templates


def test_fallback_chatml_template(tmp_path: Path) -> None:
    tok = Tokenizer.from_pretrained(write_folder(tmp_path))
    expected = (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi é<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert tok.apply_chat_template(CHAT) == expected
    no_prompt = tok.apply_chat_template(CHAT, add_generation_prompt=False)
    assert no_prompt == expected.removesuffix("<|im_start|>assistant\n")
    ids = tok.encode(tok.apply_chat_template(CHAT), add_special_tokens=False)
    assert ids.count(IM_START_ID) == 3 and ids.count(IM_END_ID) == 2


CUSTOM_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}\n"
    "[{{ m['role'] | upper }}] {{ m['content'] }}{{ eos_token }}\n"
    "{% endfor %}\n"
    "{% if tools %}{{ tools | tojson }}{% endif %}"
    "{% if add_generation_prompt %}[ASSISTANT]{% endif %}"
)


def test_custom_template_from_tokenizer_config(tmp_path: Path) -> None:
    config = {
        "chat_template": CUSTOM_TEMPLATE,
        "bos_token": "<|endoftext|>",
        "eos_token": "<|im_end|>",
    }
    tok = Tokenizer.from_pretrained(write_folder(tmp_path, config))
    rendered = tok.apply_chat_template(CHAT, tools=[{"name": "café"}])
    assert rendered == (
        "<|endoftext|>[SYSTEM] Be brief.<|im_end|>\n"
        '[USER] Hi é<|im_end|>\n[{"name": "café"}][ASSISTANT]'
    )


def test_named_template_list_uses_default(tmp_path: Path) -> None:
    templates = [
        {"name": "tool_use", "template": "TOOLS"},
        {"name": "default", "template": "DEFAULT {{ messages | length }}"},
    ]
    tok = Tokenizer.from_pretrained(write_folder(tmp_path, {"chat_template": templates}))
    assert tok.apply_chat_template(CHAT) == "DEFAULT 2"


def test_chat_template_jinja_file_takes_precedence(tmp_path: Path) -> None:
    folder = write_folder(
        tmp_path,
        {"chat_template": "FROM CONFIG"},
        {"chat_template.jinja": "FROM FILE {{ messages[0]['content'] }}"},
    )
    tok = Tokenizer.from_pretrained(folder)
    assert tok.apply_chat_template(CHAT) == "FROM FILE Be brief."
    tok.save_pretrained(tmp_path / "copy")
    assert Tokenizer.from_pretrained(tmp_path / "copy").chat_template == tok.chat_template


def test_template_raise_exception_is_value_error() -> None:
    template = (
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('user first') }}{% endif %}"
    )
    tok = Tokenizer(build_byte_tokenizer(), chat_template=template)
    with pytest.raises(ValueError, match="user first"):
        tok.apply_chat_template(CHAT)


def test_a_variable_the_template_cannot_use_is_a_param_error() -> None:
    """A caller's variable of the wrong type fails in the template: a ParamError on the
    input, not an internal error."""
    tok = Tokenizer(build_byte_tokenizer(), chat_template="{{ bos_token + messages[0].role }}")
    with pytest.raises(ParamError, match="the chat template failed on this input"):
        tok.apply_chat_template(CHAT, bos_token=5)
    assert tok.apply_chat_template(CHAT, bos_token="<s>") == "<s>system"


def test_content_parts_are_joined() -> None:
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    rendered = Tokenizer.byte_level().apply_chat_template([{"role": "user", "content": parts}])
    assert rendered.startswith("<|im_start|>user\na\nb<|im_end|>\n")


@pytest.mark.parametrize(
    ("messages", "match"),
    [
        ("hi", r"messages must be a list"),
        (["hi"], r"messages\[0\] must be a dict"),
        ([{"role": "user", "content": "a"}, {"content": "b"}], r"messages\[1\]\.role"),
        ([{"role": "user", "content": None}], r"messages\[0\]\.content"),
        (
            [{"role": "user", "content": [{"type": "image"}]}],
            r"messages\[0\]\.content\[0\]\.type",
        ),
        (
            [{"role": "user", "content": [{"type": "text", "text": 3}]}],
            r"content\[0\]\.text",
        ),
    ],
)
def test_message_validation(messages: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        Tokenizer.byte_level().apply_chat_template(messages)  # type: ignore[arg-type]


# Incremental detokenization


def test_detokenizer_byte_by_byte_never_splits_characters() -> None:
    tok = Tokenizer.byte_level()
    prompt = tok.encode(tok.apply_chat_template(CHAT), add_special_tokens=False)
    ids = tok.encode(MULTIBYTE) + [IM_END_ID]
    detok = IncrementalDetokenizer(tok, prompt)
    pieces = stream(detok, ids)
    assert not any("\ufffd" in piece for piece in pieces)
    assert "".join(pieces) == detok.text == tok.decode(ids) == MULTIBYTE
    assert pieces[ids.index(3 + 0xE6)] == ""  # first byte of 日 is held back


def test_detokenizer_keeps_special_tokens_when_asked() -> None:
    tok = Tokenizer.byte_level()
    ids = tok.encode("é<|im_end|>")
    detok = IncrementalDetokenizer(tok, [], skip_special_tokens=False)
    assert "".join(stream(detok, ids)) == "é<|im_end|>"


def test_detokenizer_flushes_incomplete_tail() -> None:
    tok = Tokenizer.byte_level()
    detok = IncrementalDetokenizer(tok, tok.encode("x"))
    assert stream(detok, byte_ids("a") + [3 + 0xE6, 3 + 0x97]) == [
        "a",
        "",
        "",
        "\ufffd",
    ]


def test_detokenizer_prompt_ending_mid_character() -> None:
    tok = Tokenizer.byte_level()
    detok = IncrementalDetokenizer(tok, byte_ids("日")[:2])
    assert "".join(stream(detok, byte_ids("本!"))) == "本!"


def test_detokenizer_does_not_hold_invalid_bytes_forever() -> None:
    tok = Tokenizer.byte_level()
    ids = [3 + 0xFF] * 20
    detok = IncrementalDetokenizer(tok, [])
    pieces = stream(detok, ids)
    assert any(pieces[:10])
    assert "".join(pieces) == tok.decode(ids) == "\ufffd" * 20


@pytest.fixture(scope="module")
def bpe_tokenizer() -> Tokenizer:
    """A small byte-level BPE trained here, whose tokens carry leading spaces like GPT-2's."""
    backend = HFTokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    sentences = [
        "the quick brown fox jumps over the lazy dog",
        "hello world, the world says hello back",
        "café au lait et crème brûlée, 日本語のテキスト",
    ] * 5
    backend.train_from_iterator(sentences, trainer=trainer)
    return Tokenizer(backend, eos_token="<|endoftext|>")


def test_detokenizer_bpe_matches_full_decode(bpe_tokenizer: Tokenizer) -> None:
    tok = bpe_tokenizer
    text = " hello world, the lazy café 日本語 🙂  fox\n jumps"
    ids = tok.encode(text)
    assert any(len(token) > 2 for token in tok.convert_ids_to_tokens(ids))  # real merges
    for prompt_text in ["", "the quick brown", "the quick brown "]:
        detok = IncrementalDetokenizer(tok, tok.encode(prompt_text))
        pieces = stream(detok, ids)
        assert "".join(pieces) == tok.decode(ids) == text
        assert not any("\ufffd" in piece for piece in pieces)


def test_token_bytes_give_the_raw_bytes_of_partial_characters(tmp_path):
    """A byte-level token holding half of a character still reports its exact byte."""
    tokenizer = Tokenizer.byte_level()
    ids = tokenizer.encode("é日x")
    assert [tokenizer.token_bytes(i) for i in ids] == [bytes([b]) for b in "é日x".encode()]
    assert tokenizer.token_bytes(2) == b"<|im_end|>"
    tokenizer.save_pretrained(tmp_path)
    reloaded = Tokenizer.from_pretrained(tmp_path)
    assert b"".join(reloaded.token_bytes(i) for i in ids) == "é日x".encode()


def test_spaces_between_special_tokens_and_skipping_them() -> None:
    """Hugging Face's rule for kept added tokens: joined with the text around them by a
    space, or by nothing; skipped, they leave the text as if absent. Streaming equals the
    whole decode either way."""
    tok = Tokenizer.byte_level()
    ids = byte_ids("ab") + [IM_END_ID] + byte_ids("c d") + [IM_START_ID, IM_END_ID]
    assert tok.decode(ids) == "abc d"
    assert tok.decode(ids, skip_special_tokens=False) == "ab<|im_end|>c d<|im_start|><|im_end|>"
    spaced = tok.decode(ids, skip_special_tokens=False, spaces_between_special_tokens=True)
    assert spaced == "ab <|im_end|> c d <|im_start|> <|im_end|>"
    assert tok.decode(ids, spaces_between_special_tokens=True) == "abc d"
    for spaces in (False, True):
        stream = IncrementalDetokenizer(tok, byte_ids("x"), False, spaces)
        text = "".join(stream.add(token) for token in ids) + stream.flush()
        assert text == tok.decode(byte_ids("x") + ids, False, spaces)[len("x") :]


@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_releasing_the_gil_encodes_the_same_ids(bpe_tokenizer: Tokenizer, add_special_tokens):
    """`release_gil` (a server's worker thread, for long prompts) changes only how the
    library is called: the same ids, special tokens and BOS included."""
    text = "the quick brown fox 日本語 <|endoftext|> café " * 500
    for tok in (bpe_tokenizer, Tokenizer.byte_level()):
        want = tok.encode(text, add_special_tokens=add_special_tokens)
        assert tok.encode(text, add_special_tokens, release_gil=True) == want
    with pytest.raises(ValueError, match="lone surrogate"):
        bpe_tokenizer.encode("x\ud800", release_gil=True)
