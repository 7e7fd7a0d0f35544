"""vLLM's prompt dicts (`from vllm.inputs import TokensPrompt, TextPrompt`) and the check
`LLM.generate` makes of each: the keys a text-only engine can honour, any other named."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypedDict

from vllm_rlt.config import ParamError, require


class TextPrompt(TypedDict):
    """A text prompt, tokenized with the model's tokenizer (special tokens added)."""

    prompt: str


class _TokensPromptIds(TypedDict):
    prompt_token_ids: list[int]


class TokensPrompt(_TokensPromptIds, total=False):
    """Token ids, run as given; `prompt` is their text, returned in the output."""

    prompt: str


PromptType = str | TextPrompt | TokensPrompt

PROMPT_KEYS = frozenset({"prompt", "prompt_token_ids"})
# vLLM's other keys, each for what this engine lacks
UNSUPPORTED_KEYS = {
    "multi_modal_data": "the models are text-only",
    "mm_processor_kwargs": "the models are text-only",
    "multi_modal_uuids": "the models are text-only",
    "token_type_ids": "no model here takes token types",
    "cache_salt": "the prefix cache is not partitioned by salt",
    "prompt_embeds": "prompts are token ids or text",
}


def check_prompt_dict(prompt: Mapping[str, Any], index: int) -> None:
    """A dict prompt holds prompt_token_ids (a list) or prompt (a string), and no key this
    engine would ignore (ParamError naming it)."""
    where = f"prompts[{index}]"
    for key in prompt:
        if key not in PROMPT_KEYS:
            reason = UNSUPPORTED_KEYS.get(key, "it is not a key of TextPrompt or TokensPrompt")
            raise ParamError(f"{where} has the key {key!r}, which is not supported: {reason}", key)
    require(
        "prompt_token_ids" in prompt or "prompt" in prompt,
        f"{where} must have 'prompt_token_ids' or 'prompt'",
        "prompts",
    )
    ids, text = prompt.get("prompt_token_ids"), prompt.get("prompt")
    require(
        ids is None or isinstance(ids, (list, tuple)),
        f"{where}['prompt_token_ids'] must be a list of token ids, got {type(ids).__name__}",
        "prompt_token_ids",
    )
    require(
        text is None or isinstance(text, str),
        f"{where}['prompt'] must be a string, got {type(text).__name__}",
        "prompt",
    )


def prompt_parts(prompt: Any, index: int = 0) -> tuple[str | None, list[int] | None]:
    """One prompt in any of vLLM's forms (a text, token ids, a `TextPrompt` or a
    `TokensPrompt`) as its text and its token ids, each None where it gives none."""
    if isinstance(prompt, str):
        return prompt, None
    if isinstance(prompt, dict):
        check_prompt_dict(prompt, index)
        ids = prompt.get("prompt_token_ids")
        return prompt.get("prompt"), list(ids) if ids is not None else None
    if isinstance(prompt, (list, tuple)):
        return None, list(prompt)
    raise ValueError(
        f"prompts[{index}] must be a string, a token-id list or a dict, got {type(prompt).__name__}"
    )
