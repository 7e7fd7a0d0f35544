"""Which browser origins may call the server (vLLM's --allowed-origins and its CORS flags).

A browser marks every cross-origin request with an `Origin` header and sends some of them
(a POST of text/plain, a POST with no body such as /pause) without asking first, so a page
on any site could drive a server on the same machine. Clients that are not browsers (SDKs,
curl) send no Origin. So a request whose Origin the list does not hold is refused with a
403, and the listed origins get CORS headers (vLLM allows every origin by default; here none
is allowed until listed, and '["*"]' gives vLLM's behaviour)."""

from __future__ import annotations

import argparse
import json
import re

_ORIGIN = re.compile(r"https?://[^/\s]+")


def json_strings(text: str) -> tuple[str, ...]:
    """An argparse type: a JSON list of strings, as vLLM takes these flags."""
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise argparse.ArgumentTypeError(
            f"must be a JSON list of strings, e.g. '[\"https://app.example\"]', got {text!r}"
        )
    return tuple(value)


def origin_problem(origin: str) -> str | None:
    """Why `origin` cannot be listed, or None: '*' or scheme://host[:port], no path."""
    if origin == "*" or _ORIGIN.fullmatch(origin):
        return None
    return f"each must be '*' or scheme://host[:port] without a path, got {origin!r}"


def origin_allowed(origin: bytes, allowed: tuple[str, ...]) -> bool:
    """Whether a request carrying this Origin header may proceed."""
    return "*" in allowed or origin.decode("latin-1") in allowed
