"""OpenAI-compatible request models; unknown fields are rejected, never ignored."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    create_model,
    model_validator,
)
from pydantic_core import PydanticCustomError

from vllm_rlt.config import ParamError
from vllm_rlt.entrypoints.openai.request_errors import (
    MAX_REQUEST_ID,
    REQUEST_ID_FORM,
    shown_json,
)
from vllm_rlt.sampling_params import (
    FIELD_BOUNDS,
    MAX_BAD_WORDS,
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    MAX_STOP_STRINGS,
    SamplingParams,
)
from vllm_rlt.token_ids import first_bad_token, shown_token, token_range
from vllm_rlt.tokenizer.chat_template import CONTROL_KEYWORDS

# Fields take only their own JSON type, as OpenAI's schema types them: an integer field
# refuses a string, a boolean or a float such as 2.0; a number field takes an integer but no
# string or boolean; a flag takes only true or false. Nothing is converted.
TokenId = StrictInt
# JSON keys are strings: a token id written as a number is (str.isdigit takes "١٢" too); no
# leading zero, so two keys never name one token, and at most 18 digits, so int() never
# meets Python's limit on digits.
_TOKEN_ID_KEY = re.compile(r"0|[1-9][0-9]{0,17}")


def check_token_ids(path: str, ids: Sequence[int], vocab_size: int) -> None:
    """ParamError naming the first of `ids` outside the vocabulary by its path ("tokens.3"),
    a huge id shortened in the message."""
    index = first_bad_token(ids, vocab_size)
    if index is not None:
        raise ParamError(
            f"{path}.{index}: must be a token id in {token_range(vocab_size)}, "
            f"got {shown_token(ids[index])}",
            f"{path}.{index}",
        )


def first_lone_surrogate(value: Any, path: str = "") -> tuple[str, int, str] | None:
    """(field path, index, character) of the first string holding a lone surrogate: JSON
    can spell one ("\\ud800"), but no valid text contains it and nothing can encode it.
    Walked with a stack of its own: a body nested thousands deep is a clear error later,
    not a recursion error here."""
    pending = [(path, value)]
    while pending:
        path, value = pending.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as exc:
                return path, exc.start, value[exc.start]
            continue
        if isinstance(value, dict):
            items = list(value.items())
            for key in value:  # a field name is text too: reported by where it stands
                found = first_lone_surrogate(key, f"{path} (a field name)".lstrip())
                if found is not None:
                    return found
        elif isinstance(value, list):
            items = list(enumerate(value))
        else:
            continue
        for key, item in reversed(items):  # popped in document order
            if isinstance(item, (str, dict, list)):  # token ids and numbers hold no text
                pending.append((f"{path}.{key}" if path else str(key), item))
    return None


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid")


class RequestBody(StrictModel):
    """A top-level request: its strings must be valid Unicode."""

    @model_validator(mode="before")
    @classmethod
    def _valid_text(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data  # not an object at all: that is the error to report
        found = first_lone_surrogate(data)
        if found is not None:
            path, index, char = found
            raise PydanticCustomError(
                "invalid_unicode",
                "{field}: character {index} is a lone surrogate (U+{code}); text must be "
                "valid Unicode",
                {"field": path, "index": index, "code": f"{ord(char):04X}"},
            )
        return data


def _field_error(field: str, message: str) -> PydanticCustomError:
    """A check across fields, reported under `field` (the error's param)."""
    return PydanticCustomError("field_error", "{field}: " + message, {"field": field})


class StreamOptions(StrictModel):
    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False  # with include_usage: usage in every event


def _bounded_fields() -> dict[str, Any]:
    """The body field of each bounded sampling field (FIELD_BOUNDS) that every request
    shares: its strict JSON type, default and range. Each takes null, as vLLM's optional
    fields do: a null is as if the field were left out (`set_fields`)."""
    made: dict[str, Any] = {}
    for name, bound in FIELD_BOUNDS.items():
        if not bound.http:
            continue
        kind: Any = StrictInt if bound.kind is int else StrictFloat
        low = {"gt" if bound.low_open else "ge": bound.kind(bound.low)}
        high = {} if not isinstance(bound.high, (int, float)) else {"le": bound.kind(bound.high)}
        made[name] = (kind | None, Field(bound.default, **low, **high))
    return made


BoundedFields = create_model("BoundedFields", __base__=RequestBody, **_bounded_fields())


class SamplingFields(BoundedFields):  # type: ignore[misc, valid-type]
    """Fields shared by completions and chat completions: the bounded sampling fields
    (BoundedFields, made from FIELD_BOUNDS) and these."""

    model: str
    max_tokens: StrictInt | None = Field(default=None, ge=1)
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP_STRINGS)] | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: StrictBool = False
    include_stop_str_in_output: StrictBool = False
    stream: StrictBool | None = False  # null: false, as vLLM's
    stream_options: StreamOptions | None = None
    user: str | None = None
    # token id (as a string, JSON's only key type) -> bias added to its logit
    logit_bias: dict[str, StrictFloat] | None = None  # ranges checked by SamplingParams
    allowed_token_ids: list[TokenId] | None = Field(default=None, min_length=1)
    bad_words: Annotated[list[str], Field(min_length=1, max_length=MAX_BAD_WORDS)] | None = None
    skip_special_tokens: StrictBool = True
    spaces_between_special_tokens: StrictBool = True
    return_exit_depths: StrictBool = False
    # vLLM's: the prompt's and each choice's token ids in the reply; logprob tokens as ids
    return_token_ids: StrictBool | None = False
    return_tokens_as_token_ids: StrictBool | None = False
    # vLLM's: only the prompt's last N tokens are kept (-1: the model's context)
    truncate_prompt_tokens: StrictInt | None = None  # its range checked with the model's
    best_of: StrictInt | None = None  # vLLM V1 dropped it: null or n (SamplingParams checks)
    # vLLM's: the n best beams of a search (request_jobs.py says which fields it takes)
    use_beam_search: StrictBool | None = False
    length_penalty: StrictFloat | None = None  # null: 1.0

    # vLLM's: named in the reply's id ("cmpl-<request_id>"); two requests may give the same
    request_id: StrictStr | None = None

    @model_validator(mode="after")
    def _printable_request_id(self) -> SamplingFields:
        given = self.request_id
        if given is not None and not (0 < len(given) <= MAX_REQUEST_ID and given.isprintable()):
            raise _field_error("request_id", f"must be {REQUEST_ID_FORM}")
        return self

    @model_validator(mode="after")
    def _stream_only_fields(self) -> SamplingFields:
        if self.stream_options is not None and not self.stream:
            raise _field_error("stream_options", "only allowed with stream=true")
        if self.prompt_logprobs and self.stream:  # as vLLM refuses it
            raise _field_error("prompt_logprobs", "above 0 is not available with stream=true")
        return self

    def sampling_params(
        self,
        max_tokens: int | None,
        num_logprobs: int | None,
        defaults: dict[str, Any] | None = None,
    ) -> SamplingParams:
        """The request's sampling; `defaults` replace the fields it left unset or null. Every field
        this body shares with SamplingParams passes under its name; the others differ in
        form (logit_bias keys as strings, the caller's max_tokens and logprobs); top_k -1
        is SamplingParams' own spelling of "every token", as vLLM's. Call it after
        check_token_ids."""
        fields = {name: getattr(self, name) for name in _SAME_AS_SAMPLING_PARAMS}
        fields = {name: value for name, value in fields.items() if value is not None}
        fields |= dict(
            max_tokens=max_tokens,
            stop_token_ids=list(self.stop_token_ids or []),
            logprobs=num_logprobs,
            logit_bias=self._logit_bias(),
        )
        return SamplingParams(**{**fields, **(defaults or {})})

    def reply_options(self) -> dict[str, bool]:
        """What the reply shows besides the text (Job's fields)."""
        return {
            "exit_depths": self.return_exit_depths,
            "token_ids": bool(self.return_token_ids),
            "tokens_as_ids": bool(self.return_tokens_as_token_ids),
        }

    def set_fields(self) -> set[str]:
        """The fields the body gives a value: left out or null, a field takes its default
        (the model's generation config's, else SamplingParams')."""
        return {name for name in self.model_fields_set if getattr(self, name) is not None}

    def _logit_bias(self) -> dict[int, float] | None:
        """The keys as ints (check_token_ids has checked them)."""
        if self.logit_bias is None:
            return None
        return {int(key): value for key, value in self.logit_bias.items()}

    def check_token_ids(self, vocab_size: int) -> None:
        """ParamError naming the first token id outside the model's vocabulary by its path
        ("stop_token_ids.2", "logit_bias.999"), or a logit_bias value out of range by its
        key: the engine's own checks name only the field, and the sampling checks before
        them know no vocabulary."""
        for name in ("stop_token_ids", "allowed_token_ids"):
            check_token_ids(name, getattr(self, name) or (), vocab_size)
        for key, bias in (self.logit_bias or {}).items():
            decimal = _TOKEN_ID_KEY.fullmatch(key) is not None
            shown = key if len(key) <= 40 else key[:40] + "..."  # in the path too
            if not (decimal and int(key) < vocab_size):
                spelling = "" if decimal else " (decimal digits, no leading zero)"
                raise ParamError(
                    f"logit_bias.{shown}: must be a token id in {token_range(vocab_size)}"
                    f"{spelling}, got {shown!r}",
                    f"logit_bias.{shown}",
                )
            if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:  # NaN too
                raise ParamError(
                    f"logit_bias.{shown}: must be in [{-MAX_LOGIT_BIAS}, {MAX_LOGIT_BIAS}], "
                    f"got {shown_json(bias)}",
                    f"logit_bias.{shown}",
                )


# Converted by `sampling_params`, or set by the endpoint (prompt logprobs, output form).
_CONVERTED = {"max_tokens", "stop_token_ids", "logprobs", "logit_bias"}
_SAME_AS_SAMPLING_PARAMS = tuple(
    f.name
    for f in dataclasses.fields(SamplingParams)
    if f.name in SamplingFields.model_fields and f.name not in _CONVERTED
)


class CompletionRequest(SamplingFields):
    """`echo` returns the prompt before the completion, and with `logprobs` the prompt
    tokens' logprobs before the generated ones' (the first prompt token has none);
    `max_tokens: 0` with `echo` returns the prompt alone (scoring, as lm-eval does)."""

    prompt: str | list[str] | list[TokenId] | list[list[TokenId]]
    max_tokens: StrictInt | None = Field(default=16, ge=0)
    logprobs: StrictInt | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: StrictBool | None = False  # null: false, as vLLM's
    add_special_tokens: StrictBool = True  # the tokenizer's (a BOS, say), as vLLM's

    @model_validator(mode="after")
    def _check(self) -> CompletionRequest:
        if isinstance(self.prompt, list) and len(self.prompt) == 0:
            raise _field_error("prompt", "must not be empty")
        if self.max_tokens == 0 and not self.echo:
            raise PydanticCustomError(
                "field_error",
                "{field}: 0 is only allowed with echo=true (it returns the prompt alone); "
                "otherwise it must be at least 1",
                {"field": "max_tokens"},
            )
        return self

    def check_token_ids(self, vocab_size: int) -> None:
        """As SamplingFields', the prompt's token ids first ("prompt.5", "prompt.1.5")."""
        prompt = self.prompt
        if isinstance(prompt, list) and isinstance(prompt[0], int):
            check_token_ids("prompt", prompt, vocab_size)  # type: ignore[arg-type]
        elif isinstance(prompt, list):
            for index, ids in enumerate(prompt):
                if isinstance(ids, list):
                    check_token_ids(f"prompt.{index}", ids, vocab_size)
        super().check_token_ids(vocab_size)

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: text or token ids."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if all(isinstance(p, int) for p in prompt):
            return [list(prompt)]  # type: ignore[arg-type]
        return list(prompt)  # type: ignore[arg-type]


class ChatMessage(StrictModel):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]]
    name: str | None = None


class ChatTemplateFields(StrictModel):
    """vLLM's chat-template controls, on chat and on /tokenize with messages: a new assistant
    message opened (default), or the last message continued; `chat_template_kwargs` are
    template variables (such as `enable_thinking`). Null counts as left out."""

    add_generation_prompt: StrictBool | None = True
    continue_final_message: StrictBool | None = False
    chat_template_kwargs: dict[str, Any] | None = None

    def template_options(self) -> dict[str, Any]:
        """apply_chat_template's keyword arguments. As in vLLM, the kwargs override the
        fields of the same names (`add_generation_prompt`, ...) and `tools` and `documents`
        among them are the template's own; the messages and the rendering's other
        arguments are refused by path ("chat_template_kwargs.tokenize")."""
        variables = dict(self.chat_template_kwargs or {})
        for name in variables:
            if name in ("add_generation_prompt", "continue_final_message"):
                value = variables[name]
                if not isinstance(value, bool):  # as strict as the fields themselves
                    raise ParamError(
                        f"chat_template_kwargs.{name}: must be true or false, got "
                        f"{shown_json(value)}",
                        f"chat_template_kwargs.{name}",
                    )
            elif name in CONTROL_KEYWORDS or name == "messages":
                raise ParamError(
                    f"chat_template_kwargs.{name}: is an argument of the chat template's "
                    "rendering, not a template variable",
                    f"chat_template_kwargs.{name}",
                )
        return {
            "add_generation_prompt": self.add_generation_prompt is not False,
            "continue_final_message": bool(self.continue_final_message),
            **variables,
        }


class ChatCompletionRequest(ChatTemplateFields, SamplingFields):
    """`echo` starts each reply with the last message's text when the reply continues its
    role (the assistant's with `add_generation_prompt`, else the last message's), as vLLM's."""

    messages: list[ChatMessage] = Field(min_length=1)
    echo: StrictBool | None = False  # null: false, as vLLM's
    add_special_tokens: StrictBool = False  # on top of the template's, as vLLM's
    max_completion_tokens: StrictInt | None = Field(default=None, ge=1)
    logprobs: StrictBool | None = False  # null: false
    top_logprobs: StrictInt | None = Field(default=None, ge=0, le=MAX_LOGPROBS)

    @model_validator(mode="after")
    def _check(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise _field_error("top_logprobs", "needs logprobs=true")
        return self


class TokenizeRequest(ChatTemplateFields, RequestBody):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)  # as chat's
    add_special_tokens: StrictBool = True

    @model_validator(mode="after")
    def _check(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise _field_error("prompt", "give exactly one of prompt or messages")
        chat_only = sorted(self.model_fields_set & ChatTemplateFields.model_fields.keys())
        if self.prompt is not None and chat_only:  # not ignored: refused, as unknown fields are
            raise _field_error(chat_only[0], "only with messages (it renders the chat template)")
        return self


class DetokenizeRequest(RequestBody):
    model: str | None = None
    tokens: list[TokenId]
