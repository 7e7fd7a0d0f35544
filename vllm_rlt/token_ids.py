"""Token-id checks shared by the offline API, the engine's request checks and the HTTP
server: each names the first bad entry and the vocabulary's range (in words where the
vocabulary is not known)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from vllm_rlt.config import ParamError, shown_int

MAX_TOKEN_ID = 2**31 - 1  # where the vocabulary is not known: int32 at most


def token_range(vocab_size: int | None) -> str:
    """The token ids a vocabulary of `vocab_size` holds (None: not known here)."""
    return "[0, vocab_size - 1]" if vocab_size is None else f"[0, {vocab_size - 1}]"


def first_bad_token(ids: Sequence[Any], vocab_size: int | None) -> int | None:
    """The index of the first entry of `ids` that is no token id of the vocabulary (where it
    is not known, none past MAX_TOKEN_ID), or None; the common case at C speed."""
    end = MAX_TOKEN_ID + 1 if vocab_size is None else vocab_size
    if all(type(token) is int for token in ids) and (not ids or 0 <= min(ids) <= max(ids) < end):
        return None
    for index, token in enumerate(ids):
        if not (isinstance(token, int) and not isinstance(token, bool) and 0 <= token < end):
            return index
    return None


def shown_token(token: Any) -> str:
    """An entry that should have been a token id, for a message (a huge id shortened)."""
    return shown_int(token) if isinstance(token, int) else repr(token)


def check_token_ids(
    name: str, ids: Sequence[Any], vocab_size: int | None = None, param: str | None = None
) -> None:
    """ParamError naming the first entry of `ids` that is no token id ("stop_token_ids[2]")
    and the range: the vocabulary's where it is known (the engine's checks), else in words."""
    index = first_bad_token(ids, vocab_size)
    if index is not None:
        raise ParamError(
            f"{name}[{index}] must be a token id in {token_range(vocab_size)}, got "
            f"{shown_token(ids[index])}",
            name if param is None else param,
        )


def check_logit_bias_keys(keys: Sequence[Any], vocab_size: int | None = None) -> None:
    """As check_token_ids, for logit_bias, whose entries are named by their keys."""
    index = first_bad_token(keys, vocab_size)
    if index is not None:
        raise ParamError(
            f"logit_bias key {shown_token(keys[index])} must be a token id in "
            f"{token_range(vocab_size)}",
            "logit_bias",
        )
