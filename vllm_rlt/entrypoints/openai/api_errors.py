"""The server's errors as OpenAI shapes them: the error object with its HTTP status, what
each failure maps to, and the JSON reply that carries it."""

from __future__ import annotations

from typing import Any

import orjson
from fastapi.responses import JSONResponse

from vllm_rlt.engine.async_llm import EngineDeadError, QueueFullError
from vllm_rlt.engine.output_processor import RequestFailedError


class APIError(Exception):
    """An OpenAI-style error: HTTP status plus the fields of the error object."""

    def __init__(
        self, status: int, message: str, kind: str = "invalid_request_error", param=None
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.status,
            }
        }


def as_api_error(exc: BaseException) -> APIError:
    """The error object a failure maps to: bad input 400, a full queue 429, a dead engine 503,
    a request the engine failed alone 500."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, QueueFullError):
        return APIError(429, str(exc), "rate_limit_error")
    if isinstance(exc, EngineDeadError):
        return APIError(503, str(exc), "service_unavailable")
    if isinstance(exc, RequestFailedError):
        return APIError(500, str(exc), "internal_error")
    if isinstance(exc, ValueError):  # "min_tokens must be ..." as the schema's "field: ..."
        param, message = getattr(exc, "param", None), str(exc)
        if param and message.startswith(f"{param} "):
            message = f"{param}: {message[len(param) + 1 :]}"
        return APIError(400, message, param=param)
    return APIError(500, f"request failed: {exc!r}", "internal_error")


class FastJSONResponse(JSONResponse):
    """JSON rendered by orjson: several times faster than the standard library."""

    def render(self, content: Any) -> bytes:
        return orjson.dumps(content)


def error_response(error: APIError, headers: dict[str, str] | None = None) -> JSONResponse:
    return FastJSONResponse(error.body(), status_code=error.status, headers=headers)
