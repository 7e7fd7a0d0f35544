"""The checks every request passes before any route runs: a browser's origin, the API key,
and the whole body read within the server's size and time limits."""

from __future__ import annotations

import asyncio
import hmac

from fastapi.responses import JSONResponse

from vllm_rlt.entrypoints.openai.api_errors import APIError, error_response
from vllm_rlt.entrypoints.openai.origins import origin_allowed

# Probes answer without the API key (a load balancer's health check carries none).
UNGUARDED_PATHS = frozenset({"/health", "/ping"})


class _BodyTooLarge(Exception):
    pass


class _ClientGone(Exception):
    pass


class GuardMiddleware:
    """Before any route runs: a request from a browser origin that `allowed_origins` does
    not hold is refused (origins.py); then the API key on every route but the probes
    (`Authorization: Bearer KEY`, the scheme in any case as RFC 9110 allows, the key
    compared in constant time), and the whole body read within the size and time limits.
    Every POST body is JSON, whatever Content-Type the client sent (`curl -d` sends a form
    type). Plain ASGI, so that handlers still see a client's disconnect."""

    def __init__(
        self,
        app,
        api_key: str | None,
        max_body: int,
        body_timeout: float,
        allowed_origins: tuple[str, ...] = (),
    ) -> None:
        self.app, self.max_body, self.body_timeout = app, max_body, body_timeout
        self.expected = None if api_key is None else api_key.encode()
        self.allowed_origins = allowed_origins

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])  # raw bytes: a header need not be UTF-8
        origin = headers.get(b"origin")
        if origin is not None and not origin_allowed(origin, self.allowed_origins):
            message = (
                f"a browser request from origin {origin.decode('latin-1')!r} is refused: "
                "--allowed-origins lists the origins that may call this server"
            )
            reply = error_response(APIError(403, message, "permission_error", "origin"))
            await reply(scope, receive, send)
            return
        keys = [value for name, value in scope["headers"] if name == b"authorization"]
        body = await self._body_or_refusal(scope["path"], headers, keys, receive)
        if body is None:
            return  # the client left while sending
        if isinstance(body, JSONResponse):
            await body(scope, receive, send)
            return
        if scope["method"] == "POST" and headers.get(b"content-type") != b"application/json":
            kept = [(k, v) for k, v in scope["headers"] if k != b"content-type"]
            scope = {**scope, "headers": [*kept, (b"content-type", b"application/json")]}
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _body_or_refusal(
        self, path: str, headers, keys: list[bytes], receive
    ) -> bytes | JSONResponse | None:
        """The whole body, or the error reply that refuses the request. `keys`: every
        Authorization header sent; each must carry the key (a repeated header is not
        settled by its order)."""
        if self.expected is not None and path not in UNGUARDED_PATHS:
            if not keys or not all(self._key_matches(key) for key in keys):
                return error_response(
                    APIError(401, "missing or wrong API key", "authentication_error")
                )
        close = {"connection": "close"}
        too_large = APIError(413, f"request body over {self.max_body} bytes", "too_large")
        length = headers.get(b"content-length", b"0")
        if length.isdigit() and int(length) > self.max_body:
            return error_response(too_large, close)
        try:
            body = await asyncio.wait_for(self._read_body(receive), self.body_timeout)
        except _BodyTooLarge:
            return error_response(too_large, close)
        except asyncio.TimeoutError:
            message = f"request body not received within {self.body_timeout:g} s"
            return error_response(APIError(408, message, "timeout_error"), close)
        except _ClientGone:
            return None
        try:
            body.decode("utf-8")
        except UnicodeDecodeError as exc:
            message = f"request body is not UTF-8 text (byte {exc.start})"
            return error_response(APIError(400, message))
        return body

    def _key_matches(self, authorization: bytes) -> bool:
        scheme, _, key = authorization.partition(b" ")
        same_key = hmac.compare_digest(key.lstrip(b" "), self.expected)
        return scheme.lower() == b"bearer" and same_key

    async def _read_body(self, receive) -> bytes:
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise _ClientGone
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body:
                raise _BodyTooLarge
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)
