"""The tokenizer `LLM.get_tokenizer()` hands to user code: Hugging Face's
`PreTrainedTokenizerFast` where transformers is installed, else `CompatTokenizer`, the subset
of it that vLLM scripts use. Both sit over the engine tokenizer's `tokenizers.Tokenizer` and
encode and decode as the engine does; the engine itself keeps its own `Tokenizer`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import tokenizers
from tokenizers import processors

from vllm_rlt.config import ParamError, require
from vllm_rlt.tokenizer.chat_template import CONTROL_KEYWORDS
from vllm_rlt.tokenizer.tokenizer import Tokenizer

INSTALL_HINT = "install transformers for the full Hugging Face tokenizer"


def user_tokenizer(tokenizer: Tokenizer) -> Any:
    """A `PreTrainedTokenizerFast` like the model's own where transformers imports, else a
    `CompatTokenizer`."""
    try:
        import transformers  # noqa: F401
    except ImportError:
        return CompatTokenizer(tokenizer)
    return hf_tokenizer(tokenizer)


def hf_tokenizer(tokenizer: Tokenizer) -> Any:
    """transformers' tokenizer over a copy of the engine's backend, with its special tokens
    and the chat template the engine renders (ChatML where the model has none)."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=_backend_with_bos(tokenizer),
        chat_template=tokenizer.chat_template,
        clean_up_tokenization_spaces=False,  # the engine's text is never cleaned up
        **tokenizer.special_tokens_map,
    )


def _backend_with_bos(tokenizer: Tokenizer) -> tokenizers.Tokenizer:
    """A copy of the backend whose post-processor adds BOS where the engine's `encode` does
    (tokenizer_config.json's add_bos_token, which transformers' generic class ignores)."""
    backend = tokenizers.Tokenizer.from_str(tokenizer.backend.to_str())
    bos, bos_id = tokenizer.bos_token, tokenizer.bos_token_id
    if not tokenizer.add_bos_token or bos is None or bos_id is None:
        return backend
    if backend.encode("a").ids[:1] == [bos_id]:
        return backend
    template = processors.TemplateProcessing(
        single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 $B:1", special_tokens=[(bos, bos_id)]
    )
    existing = backend.post_processor
    backend.post_processor = (
        template if existing is None else processors.Sequence([existing, template])
    )
    return backend


class CompatTokenizer:
    """What vLLM scripts use of a Hugging Face tokenizer, with its defaults: `decode` keeps
    special tokens, `apply_chat_template` returns token ids unless `tokenize=False`,
    `vocab_size` leaves added tokens out (`len()` counts them), a token the model does not
    declare has id None. Arguments that need transformers (padding, truncation, tensors)
    are a ParamError naming them."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._engine = tokenizer
        self._backend = tokenizer.backend
        self.chat_template = tokenizer.chat_template
        self.special_tokens_map = tokenizer.special_tokens_map

    def __repr__(self) -> str:
        return f"CompatTokenizer(vocab_size={self.vocab_size}, {self.special_tokens_map})"

    def __len__(self) -> int:
        return self._backend.get_vocab_size(with_added_tokens=True)

    @property
    def vocab_size(self) -> int:
        """The base vocabulary, without added tokens (transformers' meaning)."""
        return self._backend.get_vocab_size(with_added_tokens=False)

    @property
    def is_fast(self) -> bool:
        return True

    @property
    def eos_token(self) -> str | None:
        return self.special_tokens_map.get("eos_token")

    @property
    def bos_token(self) -> str | None:
        return self.special_tokens_map.get("bos_token")

    @property
    def pad_token(self) -> str | None:
        return self.special_tokens_map.get("pad_token")

    @property
    def unk_token(self) -> str | None:
        return self.special_tokens_map.get("unk_token")

    @property
    def eos_token_id(self) -> int | None:
        return self._token_id(self.eos_token)

    @property
    def bos_token_id(self) -> int | None:
        return self._token_id(self.bos_token)

    @property
    def pad_token_id(self) -> int | None:
        return self._token_id(self.pad_token)

    @property
    def unk_token_id(self) -> int | None:
        return self._token_id(self.unk_token)

    @property
    def all_special_tokens(self) -> list[str]:
        return list(dict.fromkeys(self.special_tokens_map.values()))

    @property
    def all_special_ids(self) -> list[int]:
        return [self._backend.token_to_id(token) for token in self.all_special_tokens]

    def get_vocab(self) -> dict[str, int]:
        return self._backend.get_vocab(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True, **kwargs: Any) -> list[int]:
        _refuse(kwargs, "encode")
        return self._engine.encode(text, add_special_tokens=add_special_tokens)

    def __call__(
        self, text: str | Sequence[str], add_special_tokens: bool = True, **kwargs: Any
    ) -> dict[str, Any]:
        """{"input_ids": ..., "attention_mask": ...} for a string or a list of strings."""
        _refuse(kwargs, "__call__")
        if isinstance(text, str):
            ids = self.encode(text, add_special_tokens)
            return {"input_ids": ids, "attention_mask": [1] * len(ids)}
        require(
            isinstance(text, (list, tuple)),
            f"text must be a string or a list of strings, got {type(text).__name__}",
            "text",
        )
        batch = [self.encode(item, add_special_tokens) for item in text]
        return {"input_ids": batch, "attention_mask": [[1] * len(ids) for ids in batch]}

    def decode(self, token_ids: int | Sequence[int], skip_special_tokens: bool = False) -> str:
        ids = [token_ids] if isinstance(token_ids, int) else list(token_ids)
        return self._engine.decode(ids, skip_special_tokens=skip_special_tokens)

    def batch_decode(
        self, sequences: Sequence[Sequence[int]], skip_special_tokens: bool = False
    ) -> list[str]:
        return [self.decode(ids, skip_special_tokens) for ids in sequences]

    def convert_ids_to_tokens(
        self, ids: int | Sequence[int], skip_special_tokens: bool = False
    ) -> str | None | list[str | None]:
        """Vocabulary strings; None for an id outside the vocabulary, as transformers."""
        if isinstance(ids, int):
            return self._backend.id_to_token(ids)
        special = set(self.all_special_ids) if skip_special_tokens else set()
        return [self._backend.id_to_token(i) for i in ids if i not in special]

    def convert_tokens_to_ids(self, tokens: str | Sequence[str]) -> int | None | list[int | None]:
        if isinstance(tokens, str):
            return self._token_id(tokens)
        return [self._token_id(token) for token in tokens]

    def apply_chat_template(
        self,
        conversation: list[dict[str, Any]] | list[list[dict[str, Any]]],
        tools: list[dict[str, Any]] | None = None,
        documents: list[dict[str, Any]] | None = None,
        chat_template: str | None = None,
        add_generation_prompt: bool = False,
        continue_final_message: bool = False,
        tokenize: bool = True,
        return_dict: bool = False,
        **kwargs: Any,
    ) -> Any:
        """transformers' rendering and result: token ids (the text encoded without special
        tokens) unless `tokenize=False`, a dict with `return_dict=True`; a list of
        conversations gives a list. Other keyword arguments are template variables."""
        _refuse({k: v for k, v in kwargs.items() if k in CONTROL_KEYWORDS}, "apply_chat_template")
        variables = {k: v for k, v in kwargs.items() if k not in CONTROL_KEYWORDS}
        batched = bool(conversation) and isinstance(conversation[0], (list, tuple))
        results = []
        for messages in conversation if batched else [conversation]:
            text = self._engine.apply_chat_template(
                list(messages),  # type: ignore[arg-type]
                add_generation_prompt,
                chat_template=chat_template,
                continue_final_message=continue_final_message,
                tools=tools,
                documents=documents,
                **variables,
            )
            results.append(text if not tokenize else self.encode(text, add_special_tokens=False))
        if tokenize and return_dict:
            masks = [[1] * len(ids) for ids in results]
            if batched:
                return {"input_ids": results, "attention_mask": masks}
            return {"input_ids": results[0], "attention_mask": masks[0]}
        return results if batched else results[0]

    def _token_id(self, token: str | None) -> int | None:
        return None if token is None else self._backend.token_to_id(token)


def _refuse(kwargs: dict[str, Any], method: str) -> None:
    """Arguments left at transformers' defaults are accepted; any other is a ParamError."""
    for name, value in kwargs.items():
        if value not in (None, False):
            raise ParamError(f"{method}: {name!r} is not supported here; {INSTALL_HINT}", name)
