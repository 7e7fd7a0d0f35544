"""Chat templates: the jinja environment transformers renders them in, the message checks,
and rendering with transformers' and vLLM's options (tools, documents, template variables,
continue_final_message), none of which lets a tokenization argument in as a variable."""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from datetime import datetime
from typing import Any

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from vllm_rlt.config import ParamError, require

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# transformers' apply_chat_template arguments that shape its result, never template variables
CONTROL_KEYWORDS = frozenset(
    {
        "chat_template",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
        "sanitize_control_tokens",
    }
)
_CONTINUE_MARK = "\x00continue-final-message\x00 "  # trailing space: see render_chat


def _raise_exception(message: str) -> None:
    """Let a template reject a conversation (e.g. roles not alternating) as a user error."""
    raise ValueError(f"chat template rejected the messages: {message}")


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    """transformers' `tojson`: unlike jinja's, it keeps non-ASCII text and skips HTML escaping."""
    return json.dumps(
        value,
        ensure_ascii=ensure_ascii,
        indent=indent,
        separators=separators,
        sort_keys=sort_keys,
    )


def _strftime_now(fmt: str) -> str:
    """transformers' `strftime_now`, which templates such as Llama 3's use for today's date."""
    return datetime.now().strftime(fmt)


def _template_environment() -> ImmutableSandboxedEnvironment:
    """The jinja environment transformers renders chat templates in, so templates render alike."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


_TEMPLATE_ENV = _template_environment()


@functools.lru_cache(maxsize=16)
def compile_template(source: str) -> jinja2.Template:
    """A template compiled once, on first use (so a model with a broken template still
    serves completions); ValueError when it does not compile."""
    try:
        return _TEMPLATE_ENV.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise ValueError(f"chat template does not compile: {exc}") from exc


def message_text(content: Any, where: str) -> str:
    """A message's text: a string, or OpenAI-style text parts joined with newlines (as vLLM)."""
    if isinstance(content, str):
        return content
    require(
        isinstance(content, list),
        f"{where} must be a string or a list of text parts, got {type(content).__name__}",
        where,
    )
    texts = []
    for j, part in enumerate(content):
        at = f"{where}[{j}]"
        require(isinstance(part, Mapping), f"{at} must be a dict, got {type(part).__name__}", at)
        kind = part.get("type")
        require(kind == "text", f"{at}.type must be 'text', got {kind!r}", f"{at}.type")
        unknown = sorted(str(key) for key in part if key not in ("type", "text"))
        require(not unknown, f"{at} has unknown field(s): {', '.join(unknown)}", at)
        text = part.get("text")
        require(
            isinstance(text, str),
            f"{at}.text must be a string, got {type(text).__name__}",
            f"{at}.text",
        )
        texts.append(text)
    return "\n".join(texts)


def normalize_messages(messages: Any) -> list[dict[str, Any]]:
    """Check a conversation and give each message plain-string content for the template."""
    require(
        isinstance(messages, list),
        f"messages must be a list of dicts, got {type(messages).__name__}",
        "messages",
    )
    normalized = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        require(
            isinstance(message, Mapping),
            f"{where} must be a dict, got {type(message).__name__}",
            where,
        )
        role = message.get("role")
        require(
            isinstance(role, str),
            f"{where}.role must be a string, got {type(role).__name__}",
            f"{where}.role",
        )
        content = message_text(message.get("content"), f"{where}.content")
        normalized.append({**message, "content": content})
    return normalized


def render_chat(
    template: str,
    messages: Any,
    *,
    add_generation_prompt: bool,
    continue_final_message: bool = False,
    tools: list[dict[str, Any]] | None = None,
    documents: list[dict[str, Any]] | None = None,
    variables: Mapping[str, Any] | None = None,
) -> str:
    """A conversation rendered as transformers renders it: `tools` and `documents` are
    always defined (None when not given), `variables` (special tokens, a caller's
    chat_template_kwargs) become template variables, and `continue_final_message` ends the
    text right after the last message's content, ready for the model to go on with it."""
    variables = dict(variables or {})
    for name in variables:
        require(
            name not in CONTROL_KEYWORDS,
            f"{name!r} is an argument of apply_chat_template, not a template variable",
            name,
        )
    require(
        not (continue_final_message and add_generation_prompt),
        "continue_final_message needs add_generation_prompt false: the first continues the "
        "last message, the second starts a new assistant message",
        "continue_final_message",
    )
    for name, value in (("tools", tools), ("documents", documents)):
        require(
            value is None
            or (isinstance(value, list) and all(isinstance(v, Mapping) for v in value)),
            f"{name} must be a list of dicts"
            + (" (JSON schemas for tools)" if name == "tools" else ""),
            name,
        )
    messages = normalize_messages(messages)
    if continue_final_message:
        require(bool(messages), "continue_final_message needs a message to continue", "messages")
        last = messages[-1]
        messages[-1] = {**last, "content": last["content"] + _CONTINUE_MARK}
    try:
        context = {  # a dict: any variable name is the caller's, "self" too
            **variables,
            "messages": messages,
            "tools": tools,
            "documents": documents,
            "add_generation_prompt": add_generation_prompt,
        }
        text = compile_template(template).render(context)
    except (jinja2.TemplateError, TypeError, LookupError, AttributeError, ArithmeticError) as exc:
        # A variable or message of a type the template cannot use: the caller's input.
        raise ParamError(f"the chat template failed on this input: {exc}", "messages") from exc
    if continue_final_message:
        mark = text.rfind(_CONTINUE_MARK.strip())
        if mark < 0:
            raise ParamError(
                "continue_final_message is set but the chat template does not render the final "
                "message's content as it is",
                "continue_final_message",
            )
        # A template that strips the content took the message's trailing space too.
        whole = text.startswith(_CONTINUE_MARK, mark)
        text = text[:mark] if whole else text[:mark].rstrip()
    return text
