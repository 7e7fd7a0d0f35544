"""OpenAI-compatible request models; unknown fields are rejected, never ignored."""

from __future__ import annotations

import dataclasses
import json
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
    create_model,
    model_validator,
)
from pydantic_core import PydanticCustomError

from vllm_rlt.config import ParamError, shown_int
from vllm_rlt.sampling_params import (
    FIELD_BOUNDS,
    MAX_BAD_WORDS,
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    MAX_STOP_STRINGS,
    SamplingParams,
)
from vllm_rlt.token_ids import first_bad_token, shown_token, token_range

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
    best_of: StrictInt | None = None  # vLLM V1 dropped it: null or n (SamplingParams checks)

    @model_validator(mode="after")
    def _stream_options_need_a_stream(self) -> SamplingFields:
        if self.stream_options is not None and not self.stream:
            raise _field_error("stream_options", "only allowed with stream=true")
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
                    f"got {_shown_json(bias)}",
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


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = Field(default=None, ge=1)
    logprobs: StrictBool | None = False  # null: false
    top_logprobs: StrictInt | None = Field(default=None, ge=0, le=MAX_LOGPROBS)

    @model_validator(mode="after")
    def _check(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise _field_error("top_logprobs", "needs logprobs=true")
        return self


class TokenizeRequest(RequestBody):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)  # as chat's
    add_special_tokens: StrictBool = True

    @model_validator(mode="after")
    def _check(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise _field_error("prompt", "give exactly one of prompt or messages")
        return self


class DetokenizeRequest(RequestBody):
    model: str | None = None
    tokens: list[TokenId]


# A union member's name in an error location ("str", "list[int]"): not a field.
_UNION_TAG = re.compile(r"^(str|int|float|bool|none)$|\[")
_BOUND_ERRORS = {"greater_than", "greater_than_equal", "less_than", "less_than_equal"}
# An object was expected: pydantic's words depend on how the body was parsed.
_OBJECT_ERRORS = {"model_type", "model_attributes_type", "dict_type"}
_MESSAGES = {
    "int_parsing_size": "integer out of range",
    "int_type": "must be an integer",
    "float_type": "must be a number",
    "finite_number": "must be a finite number",
    **{kind: "must be a JSON object" for kind in _OBJECT_ERRORS},
}
# What the prompt of /v1/completions may be, for an entry that fits none of its forms.
_PROMPT_FORMS = "a prompt is text, a list of texts, token ids or a list of token-id lists"
# Bounded above by what the body's schema cannot know: the served model's depth, or the
# context (max_model_len) less the prompt. The schema checks the low end, the engine the
# high end, and both messages give the range.
DEPTH_BOUNDED = frozenset({"min_loops", "max_loops"})
CONTEXT_BOUNDED = frozenset({"max_tokens", "max_completion_tokens"})
# Lists of token ids: each entry is bounded by the vocabulary.
TOKEN_ID_LISTS = frozenset({"tokens", "stop_token_ids", "allowed_token_ids"})


@dataclasses.dataclass(frozen=True)
class ServedLimits:
    """The served model's bounds on request fields (None while it loads): its depth,
    context length and the vocabulary of the route's token ids."""

    depth: int | None = None
    max_model_len: int | None = None
    vocab_size: int | None = None


UNKNOWN_LIMITS = ServedLimits()


def _json_kind(value: Any) -> str:
    """A decoded JSON value's type, in JSON's words."""
    if isinstance(value, list):
        return "an array"
    if isinstance(value, dict):
        return "an object"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    return "a string" if isinstance(value, str) else "null"


def describe_validation_error(
    errors: list[dict[str, Any]],
    model: type[BaseModel] | None,
    served: ServedLimits = UNKNOWN_LIMITS,
) -> tuple[str, str | None]:
    """(message, param) for a failed request body: the field, what is wrong with it and,
    for a bounded number, its allowed range; `served` gives the upper ends the schema
    cannot know."""
    if not errors:
        return "invalid request", None
    # Each member of a union reports its own error; a member's type mismatch says least.
    best = next((e for e in errors if not e["type"].endswith("_type")), errors[0])
    kind = best["type"]
    if kind in ("invalid_unicode", "field_error"):  # raised by our own validators
        return best["msg"], best["ctx"]["field"]
    if kind == "json_invalid":
        return f"request body is not valid JSON: {best.get('msg', '')}", None
    location = list(best.get("loc", ()))
    if location[:1] in (["body"], ["query"]):  # where FastAPI found it, not its name
        location = location[1:]
    if kind == "missing" and not location:
        return "request body is missing: send a JSON object", None
    if kind in _OBJECT_ERRORS and not location:  # no field is at fault: param stays null
        body = _json_kind(best.get("input"))
        return f"request body must be a JSON object, got {body}", None
    param = ".".join(str(p) for p in location if not _UNION_TAG.search(str(p))) or None
    if kind == "extra_forbidden":
        return f"unsupported field: {param}", param
    if best is errors[0] and kind.endswith("_type"):
        tags = [str(p) for e in errors for p in e.get("loc", ()) if _UNION_TAG.search(str(p))]
        whole = best.get("input")
        if param and "list[int]" in tags and isinstance(whole, list) and whole:
            found = _prompt_entry_error(param, whole, served.vocab_size)
            if found is not None:
                return found
        if param and "list[str]" in tags and isinstance(whole, list):
            bad = next((i for i, v in enumerate(whole) if not isinstance(v, str)), None)
            if bad is not None:  # a list of texts (stop) with an entry that is not one
                return (
                    f"{param}.{bad}: must be a string, got {_shown_json(whole[bad])} ({param} "
                    "is a string or an array of strings)",
                    f"{param}.{bad}",
                )
        if len(tags) > 1:
            return f"{param}: wrong type ({', '.join(dict.fromkeys(tags))} accepted)", param
    message = _MESSAGES.get(kind, best.get("msg", "invalid value"))
    allowed = _allowed_range(model, param, served) if model is not None and param else None
    if allowed and kind in _BOUND_ERRORS:
        message = f"must be in {allowed}, got {_shown_json(best.get('input'))}"
    elif allowed:
        message = f"{message} (allowed: {allowed})"
    return (f"{param}: {message}" if param else message), param


def _shown_json(value: Any) -> str:
    """A value of the body for a message, as JSON spells it: an array or object by its kind,
    a huge integer or a long string shortened."""
    if isinstance(value, (list, dict)):
        return _json_kind(value)
    if isinstance(value, int) and not isinstance(value, bool):
        return shown_int(value)
    text = json.dumps(value, ensure_ascii=False)
    return text if len(text) <= 40 else f"{text[:40]}..."


def _is_token_id(value: Any) -> bool:
    """An integer, and not JSON's true or false (which Python counts as integers)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _prompt_entry_error(
    field: str, prompt: list[Any], vocab_size: int | None
) -> tuple[str, str] | None:
    """(message, param) naming by its path the first entry of a prompt list that breaks the
    form its first entry sets (token ids, token-id lists or texts): each form's own error
    names only the field, or an entry of a form the client did not mean."""
    token = f"a token id in {token_range(vocab_size)}"
    first = prompt[0]
    for index, entry in enumerate(prompt):
        path, want = f"{field}.{index}", None
        if _is_token_id(first):
            want = None if _is_token_id(entry) else token
        elif isinstance(first, list):
            if not isinstance(entry, list):
                want = f"a list of token ids in {token_range(vocab_size)}"
            else:
                inner = next((j for j, t in enumerate(entry) if not _is_token_id(t)), None)
                if inner is not None:
                    path, want, entry = f"{path}.{inner}", token, entry[inner]
        elif isinstance(first, str):
            want = None if isinstance(entry, str) else "a string"
        else:
            want = f"{token}, a list of them or a string"
        if want is not None:
            message = f"{path}: must be {want}, got {_shown_json(entry)}; {_PROMPT_FORMS}"
            return message, path
    return None


def _allowed_range(model: type[BaseModel], param: str, served: ServedLimits) -> str | None:
    name, _, entry = param.partition(".")
    if name in TOKEN_ID_LISTS and entry.isdigit() and name in model.model_fields:
        return token_range(served.vocab_size)
    field = model.model_fields.get(param)
    if field is None:
        return None
    low = None
    high: Any = None
    low_open = high_open = False
    for bound in field.metadata:
        if hasattr(bound, "ge"):
            low = bound.ge
        elif hasattr(bound, "gt"):
            low, low_open = bound.gt, True
        if hasattr(bound, "le"):
            high = bound.le
        elif hasattr(bound, "lt"):
            high, high_open = bound.lt, True
    if high is None:
        high = _served_high(param, served)
    if low is None and high is None:
        return None
    left = "(" if low_open or low is None else "["
    right = ")" if high_open or high is None else "]"
    return f"{left}{'-inf' if low is None else low}, {'inf' if high is None else high}{right}"


def _served_high(param: str, served: ServedLimits) -> Any:
    """The upper end of a field the schema leaves open, where something else bounds it:
    the model's depth, the room the context leaves after the prompt (prompt + max_tokens
    beyond max_model_len is refused, as vLLM refuses it), or another field's value."""
    if param in DEPTH_BOUNDED:
        return "the model's depth" if served.depth is None else served.depth
    if param in CONTEXT_BOUNDED:
        context = "max_model_len" if served.max_model_len is None else served.max_model_len
        return f"{context} - prompt tokens"
    bound = FIELD_BOUNDS.get(param)
    return bound.high if bound is not None and isinstance(bound.high, str) else None
