"""Tokenizer: a HF `tokenizers.Tokenizer` plus the tokenizer_config.json settings the engine uses.

The engine needs ids, text, end-of-sequence ids and chat rendering only, so it reads a HF model
folder's tokenizer files itself rather than depending on transformers.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import decoders

from vllm_rlt.config import require, require_valid_text
from vllm_rlt.tokenizer.byte_level import (
    ENDOFTEXT_ID,
    IM_END_ID,
    SPECIAL_TOKENS,
    build_byte_tokenizer,
    byte_values,
)
from vllm_rlt.tokenizer.chat_template import CHATML_TEMPLATE, render_chat

TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"
TEMPLATE_FILE = "chat_template.jinja"
GENERATION_CONFIG_FILE = "generation_config.json"
# Texts longer than this are tokenized with the GIL released (`encode`'s release_gil) where
# an event loop serves other clients beside it: with the GIL held, a 1 MB prompt left the
# loop 19 turns a second (734,000 released), so every other client stalled for the 0.7 s.
GIL_FREE_CHARS = 16 * 1024


def read_json_object(path: Path) -> dict[str, Any]:
    """A JSON object file's contents, {} when the file is absent; ValueError naming a bad file."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except RecursionError:
        raise ValueError(f"cannot read {path}: JSON nested too deeply") from None
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read {path}: {exc}") from exc
    require(
        isinstance(data, dict),
        f"{path}: must hold a JSON object, got {type(data).__name__}",
    )
    return data


def _write_json(path: Path, data: Mapping[str, Any]) -> None:
    """Indented and UTF-8, like the files transformers writes."""
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _token_content(value: Any, name: str) -> str | None:
    """A special token given as a string or as a serialized AddedToken ({"content": ...})."""
    if isinstance(value, Mapping):
        value = value.get("content")
        if value is None:
            raise ValueError(f"{CONFIG_FILE}: {name} has no 'content'")
    if value is not None and not isinstance(value, str):
        raise ValueError(f"{CONFIG_FILE}: {name} must be a string, got {value!r}")
    return value


def _config_template(config: Mapping[str, Any]) -> str | None:
    """tokenizer_config.json's chat_template: a string, or named templates of which "default"."""
    template = config.get("chat_template")
    if template is None or isinstance(template, str):
        return template
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        if isinstance(named.get("default"), str):
            return named["default"]
        raise ValueError(
            f"{CONFIG_FILE}: chat_template list has no 'default' template "
            f"(names: {sorted(map(str, named))})"
        )
    raise ValueError(f"{CONFIG_FILE}: chat_template must be a string or a list of templates")


def generation_eos_ids(value: Any) -> list[int]:
    """generation_config.json's eos_token_id: absent, one id or a list of ids."""
    ids = [] if value is None else value if isinstance(value, list) else [value]
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ValueError(
            f"{GENERATION_CONFIG_FILE}: eos_token_id must be an int or a list of ints, "
            f"got {value!r}"
        )
    return ids


def _add_declared_tokens(backend: tokenizers.Tokenizer, declared: Any) -> None:
    """Add tokens that tokenizer_config.json declares but tokenizer.json lacks, at their ids."""
    require(
        isinstance(declared, Mapping),
        f"{CONFIG_FILE}: added_tokens_decoder must map ids to tokens",
    )
    entries = []
    for key, spec in declared.items():
        if not (
            key.isdigit() and isinstance(spec, Mapping) and isinstance(spec.get("content"), str)
        ):
            raise ValueError(
                f"{CONFIG_FILE}: added_tokens_decoder[{key!r}] must map a token id to "
                f"{{'content': str, ...}}, got {spec!r}"
            )
        entries.append((int(key), spec))
    known = backend.get_added_tokens_decoder()
    for token_id, spec in sorted(entries, key=lambda entry: entry[0]):
        content = spec["content"]
        if token_id in known:
            if known[token_id].content != content:
                raise ValueError(
                    f"{CONFIG_FILE}: added_tokens_decoder[{token_id}] is {content!r} but "
                    f"{TOKENIZER_FILE} has {known[token_id].content!r} there"
                )
            continue
        special = bool(spec.get("special", False))
        token = tokenizers.AddedToken(
            content,
            single_word=bool(spec.get("single_word", False)),
            lstrip=bool(spec.get("lstrip", False)),
            rstrip=bool(spec.get("rstrip", False)),
            normalized=bool(spec.get("normalized", not special)),
            special=special,
        )
        if special:
            backend.add_special_tokens([token])
        else:
            backend.add_tokens([token])
        actual = backend.token_to_id(content)
        if actual != token_id:
            raise ValueError(
                f"{CONFIG_FILE}: added_tokens_decoder puts {content!r} at id {token_id} "
                f"but the tokenizer gives it id {actual}"
            )


def _added_token_dict(token: tokenizers.AddedToken) -> dict[str, Any]:
    """An AddedToken in tokenizer_config.json's added_tokens_decoder form."""
    return {
        "content": token.content,
        "lstrip": token.lstrip,
        "normalized": token.normalized,
        "rstrip": token.rstrip,
        "single_word": token.single_word,
        "special": token.special,
    }


class Tokenizer:
    """Text <-> ids, end-of-sequence ids and chat rendering for one model.

    `chat_template=None` means the model has none and the ChatML fallback is used; it is kept
    apart so that `save_pretrained` does not write a template the model never had.
    """

    def __init__(
        self,
        tokenizer: tokenizers.Tokenizer,
        *,
        chat_template: str | None = None,
        bos_token: str | None = None,
        eos_token: str | None = None,
        extra_eos_token_ids: Iterable[int] = (),
        add_bos_token: bool = False,
        pad_token: str | None = None,
        unk_token: str | None = None,
    ) -> None:
        self._tokenizer = tokenizer
        self._chat_template = chat_template
        self._bos_token = bos_token
        self._eos_token = eos_token
        self._add_bos_token = add_bos_token
        # Used by nothing in the engine, so one outside the vocabulary is dropped rather
        # than failing the load (transformers would add it as a new token).
        self._pad_token, self._unk_token = (
            token if token is not None and tokenizer.token_to_id(token) is not None else None
            for token in (pad_token, unk_token)
        )
        self._bos_id = None if bos_token is None else self._token_id(bos_token, "bos_token")
        self._eos_id = None if eos_token is None else self._token_id(eos_token, "eos_token")
        eos_ids = set(extra_eos_token_ids)
        for token_id in eos_ids:  # eos_token is looked up in the vocabulary, so is in it
            if not 0 <= token_id < self.vocab_size:
                raise ValueError(
                    f"{GENERATION_CONFIG_FILE}: eos_token_id {token_id} is outside the "
                    f"vocabulary [0, {self.vocab_size})"
                )
        if self._eos_id is not None:
            eos_ids.add(self._eos_id)
        self._eos_ids = frozenset(eos_ids)

    @classmethod
    def from_pretrained(cls, path: str | Path) -> Tokenizer:
        """Load the tokenizer of a HF model folder.

        Reads tokenizer.json and, when present, tokenizer_config.json, chat_template.jinja
        (which wins over tokenizer_config.json's template, as in recent transformers) and
        generation_config.json's eos_token_id (added to the eos ids).
        """
        folder = Path(path)
        tokenizer_file = folder / TOKENIZER_FILE
        if not tokenizer_file.is_file():
            raise FileNotFoundError(f"no {TOKENIZER_FILE} in {folder}: {tokenizer_file}")
        try:
            backend = tokenizers.Tokenizer.from_file(str(tokenizer_file))
        except Exception as exc:  # the library raises a bare Exception for a bad file
            raise ValueError(f"cannot read {tokenizer_file}: {exc}") from exc
        config = read_json_object(folder / CONFIG_FILE)
        generation = read_json_object(folder / GENERATION_CONFIG_FILE)
        _add_declared_tokens(backend, config.get("added_tokens_decoder", {}))
        add_bos_token = config.get("add_bos_token", False)
        require(
            isinstance(add_bos_token, bool),
            f"{CONFIG_FILE}: add_bos_token must be a bool, got {add_bos_token!r}",
        )
        template_file = folder / TEMPLATE_FILE
        if template_file.is_file():
            chat_template = template_file.read_text(encoding="utf-8")
        else:
            chat_template = _config_template(config)
        try:
            return cls(
                backend,
                chat_template=chat_template,
                bos_token=_token_content(config.get("bos_token"), "bos_token"),
                eos_token=_token_content(config.get("eos_token"), "eos_token"),
                extra_eos_token_ids=generation_eos_ids(generation.get("eos_token_id")),
                add_bos_token=add_bos_token,
                pad_token=_token_content(config.get("pad_token"), "pad_token"),
                unk_token=_token_content(config.get("unk_token"), "unk_token"),
            )
        except ValueError as exc:
            raise ValueError(f"{folder}: {exc}") from exc

    @classmethod
    def byte_level(cls, chat_template: str = CHATML_TEMPLATE) -> Tokenizer:
        """The built-in byte tokenizer; both <|endoftext|> and <|im_end|> end generation."""
        return cls(
            build_byte_tokenizer(),
            chat_template=chat_template,
            eos_token=SPECIAL_TOKENS[IM_END_ID],
            extra_eos_token_ids=(ENDOFTEXT_ID,),
        )

    def save_pretrained(self, path: str | Path) -> None:
        """Write files that `from_pretrained` (and transformers) read back as this tokenizer.

        eos ids beyond eos_token go to generation_config.json's eos_token_id, merged into an
        existing file, since tokenizer_config.json holds a single eos_token.
        """
        folder = Path(path)
        folder.mkdir(parents=True, exist_ok=True)
        self._tokenizer.save(str(folder / TOKENIZER_FILE))
        added = sorted(self._tokenizer.get_added_tokens_decoder().items())
        config: dict[str, Any] = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": self._bos_token,
            "eos_token": self._eos_token,
            "add_bos_token": self._add_bos_token,
            "added_tokens_decoder": {str(i): _added_token_dict(t) for i, t in added},
        }
        config.update(self.special_tokens_map)  # adds unk_token and pad_token where set
        if self._chat_template is not None:
            config["chat_template"] = self._chat_template
        _write_json(folder / CONFIG_FILE, config)
        generation_file = folder / GENERATION_CONFIG_FILE
        primary = [] if self._eos_id is None else [self._eos_id]
        extra = sorted(self._eos_ids - set(primary))
        if extra or generation_file.is_file():
            generation = read_json_object(generation_file)
            generation["eos_token_id"] = primary + extra
            _write_json(generation_file, generation)

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included."""
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """Every id that ends generation."""
        return self._eos_ids

    @property
    def eos_token(self) -> str | None:
        """The EOS token's text, None when the model declares none."""
        return self._eos_token

    @property
    def bos_token(self) -> str | None:
        """The BOS token's text, None when the model declares none."""
        return self._bos_token

    @property
    def bos_token_id(self) -> int | None:
        """The BOS id, None when the model declares no BOS token."""
        return self._bos_id

    @property
    def add_bos_token(self) -> bool:
        """tokenizer_config.json's add_bos_token (see `encode`)."""
        return self._add_bos_token

    @property
    def special_tokens_map(self) -> dict[str, str]:
        """The declared special tokens by transformers' names (bos_token, eos_token,
        unk_token, pad_token)."""
        tokens = {
            "bos_token": self._bos_token,
            "eos_token": self._eos_token,
            "unk_token": self._unk_token,
            "pad_token": self._pad_token,
        }
        return {name: token for name, token in tokens.items() if token is not None}

    @property
    def backend(self) -> tokenizers.Tokenizer:
        """The `tokenizers.Tokenizer` underneath (not to be changed: the engine uses it)."""
        return self._tokenizer

    @property
    def chat_template(self) -> str:
        """The template `apply_chat_template` renders: the model's, else ChatML."""
        return CHATML_TEMPLATE if self._chat_template is None else self._chat_template

    def encode(
        self, text: str, add_special_tokens: bool = True, release_gil: bool = False
    ) -> list[int]:
        """Token ids of `text`.

        With special tokens: whatever the post-processor adds, plus BOS when
        tokenizer_config.json sets add_bos_token and the post-processor did not put it first.
        `release_gil`: encode through `encode_batch`, which lets other threads run while it
        works (`encode` holds the GIL throughout), for a server's worker thread; the
        tokenizers library may then warn if the process forks later.
        """
        require_valid_text(text, "prompt")
        ids = self._encoding(text, add_special_tokens, release_gil).ids
        return self._with_bos(ids, add_special_tokens)

    def left_truncated(
        self,
        text: str,
        ids: list[int],
        keep: int,
        add_special_tokens: bool = True,
        release_gil: bool = False,
    ) -> list[int]:
        """`keep` of `text`'s ids (`ids`, as `encode` gave them), as transformers truncates a
        prompt on the left for vLLM: the text's first tokens dropped, the special tokens
        encoding added kept; the last `keep` ids where fewer than those fit."""
        if len(ids) <= keep:
            return ids
        if not add_special_tokens:
            return ids[-keep:]
        plain = self._encoding(text, False, release_gil)
        added = len(ids) - len(plain.ids)
        if added <= 0 or keep <= added:
            return ids[-keep:]
        plain.truncate(keep - added, direction="left")
        return self._with_bos(self._tokenizer.post_process(plain).ids, True)

    def _encoding(
        self, text: str, add_special_tokens: bool, release_gil: bool
    ) -> tokenizers.Encoding:
        if release_gil:
            return self._tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0]
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def _with_bos(self, ids: list[int], add_special_tokens: bool) -> list[int]:
        if (
            add_special_tokens
            and self._add_bos_token
            and self._bos_id is not None
            and ids[:1] != [self._bos_id]
        ):
            ids.insert(0, self._bos_id)
        return ids

    def decode(
        self,
        ids: Sequence[int],
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = False,
    ) -> str:
        """Text of `ids`; incomplete or invalid UTF-8 byte sequences come out as U+FFFD.

        `spaces_between_special_tokens` follows Hugging Face's slow tokenizers: the added
        tokens kept in the text and the runs of text between them are joined with spaces
        (the fast tokenizers, like this one by default, join them with nothing)."""
        ids = list(ids)
        if not spaces_between_special_tokens:
            return self._tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        added = self._tokenizer.get_added_tokens_decoder()
        parts, run = [], []
        for token_id in ids:
            token = added.get(token_id)
            if token is None:
                run.append(token_id)
            elif not (skip_special_tokens and token.special):
                if run:
                    parts.append(self._tokenizer.decode(run, skip_special_tokens=False))
                parts.append(token.content)
                run = []
        if run:
            parts.append(self._tokenizer.decode(run, skip_special_tokens=False))
        return " ".join(parts)

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes one token stands for (a byte-level token may hold part of a
        character, which its decoded text cannot show)."""
        token = self.convert_ids_to_tokens([token_id])[0]
        added = self._tokenizer.get_added_tokens_decoder()
        if isinstance(self._tokenizer.decoder, decoders.ByteLevel) and token_id not in added:
            table = byte_values()
            if all(char in table for char in token):
                return bytes(table[char] for char in token)
        return self.decode([token_id], skip_special_tokens=False).encode()

    def convert_ids_to_tokens(self, ids: Iterable[int]) -> list[str]:
        """Vocabulary strings of `ids`; ValueError for an id outside the vocabulary."""
        tokens = []
        for token_id in ids:
            token = self._tokenizer.id_to_token(token_id)
            if token is None:
                raise ValueError(
                    f"token id {token_id} is outside the vocabulary [0, {self.vocab_size})"
                )
            tokens.append(token)
        return tokens

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        /,
        add_generation_prompt: bool = True,
        *,
        chat_template: str | None = None,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        documents: list[dict[str, Any]] | None = None,
        **variables: Any,
    ) -> str:
        """Render a conversation to prompt text, as transformers would (chat_template.py),
        with `chat_template` in place of the model's when given.

        Other keyword arguments become template variables, as do the special tokens; one of
        transformers' tokenization arguments (`tokenize`, ...) is a ParamError. The text may
        already hold BOS, so encode it with add_special_tokens=False.
        """
        return render_chat(
            self.chat_template if chat_template is None else chat_template,
            messages,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            tools=tools,
            documents=documents,
            variables={**self.special_tokens_map, **variables},
        )

    def _token_id(self, token: str, name: str) -> int:
        """The id of a configured token, which must be in the vocabulary to be of any use."""
        token_id = self._tokenizer.token_to_id(token)
        if token_id is None:
            raise ValueError(f"{name} {token!r} is not in the vocabulary")
        return token_id
