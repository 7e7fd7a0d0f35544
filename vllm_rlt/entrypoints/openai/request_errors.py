"""Pydantic's errors for a request body as the API's errors: the field by its path, what
is wrong with it and, for a bounded number, its allowed range; the served model gives the
upper ends a schema cannot know (its depth, its context, its vocabulary)."""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any

from pydantic import BaseModel

from vllm_rlt.config import shown_int
from vllm_rlt.sampling_params import FIELD_BOUNDS, MAX_LOGIT_BIAS
from vllm_rlt.token_ids import token_range

# A union member's name in an error location ("str", "list[int]"): not a field.
_UNION_TAG = re.compile(r"^(str|int|float|bool|none)$|\[")
_BOUND_ERRORS = {"greater_than", "greater_than_equal", "less_than", "less_than_equal"}
# An object was expected: pydantic's words depend on how the body was parsed.
_OBJECT_ERRORS = {"model_type", "model_attributes_type", "dict_type"}
_MESSAGES = {
    "int_parsing_size": "integer out of range",
    "int_type": "must be an integer",
    "float_type": "must be a number",
    "bool_type": "must be true or false",
    "string_type": "must be a string",
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
# A client's request id goes into reply ids and log lines: printable, and not long.
MAX_REQUEST_ID = 256
REQUEST_ID_FORM = f"1 to {MAX_REQUEST_ID} printable characters"
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
                    f"{param}.{bad}: must be a string, got {shown_json(whole[bad])} ({param} "
                    "is a string or an array of strings)",
                    f"{param}.{bad}",
                )
        if len(tags) > 1:
            return f"{param}: wrong type ({', '.join(dict.fromkeys(tags))} accepted)", param
    message = _MESSAGES.get(kind, best.get("msg", "invalid value"))
    allowed = _allowed_range(model, param, served) if model is not None and param else None
    if allowed and kind in _BOUND_ERRORS:
        message = f"must be in {allowed}, got {shown_json(best.get('input'))}"
    elif allowed:
        message = f"{message} (allowed: {allowed})"
    return (f"{param}: {message}" if param else message), param


def shown_json(value: Any) -> str:
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
            message = f"{path}: must be {want}, got {shown_json(entry)}; {_PROMPT_FORMS}"
            return message, path
    return None


def _allowed_range(model: type[BaseModel], param: str, served: ServedLimits) -> str | None:
    name, _, entry = param.partition(".")
    if name in TOKEN_ID_LISTS and entry.isdigit() and name in model.model_fields:
        return token_range(served.vocab_size)
    if name == "logit_bias" and entry and name in model.model_fields:  # an entry's value
        return f"[{-MAX_LOGIT_BIAS}, {MAX_LOGIT_BIAS}]"
    if param == "request_id" and name in model.model_fields:
        return REQUEST_ID_FORM
    if param == "truncate_prompt_tokens" and name in model.model_fields:
        return f"-1 or [1, {served.max_model_len or 'max_model_len'}]"
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
