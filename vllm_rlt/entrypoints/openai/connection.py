"""Connections and process lifetime under uvicorn: limits on what a client may hold open,
JSON error bodies even for requests too broken to reach the app, and a drained shutdown."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
import threading
from collections.abc import Callable

import uvicorn

logger = logging.getLogger("vllm_rlt.server")

_REASONS = {400: "Bad Request", 503: "Service Unavailable"}


def error_body(status: int, message: str, kind: str) -> bytes:
    """An OpenAI-shaped error object, encoded."""
    error = {"message": message, "type": kind, "param": None, "code": status}
    return json.dumps({"error": error}).encode()


def raw_error(status: int, message: str, kind: str) -> bytes:
    """A whole HTTP/1.1 response carrying an error object; it closes the connection."""
    body = error_body(status, message, kind)
    head = (
        f"HTTP/1.1 {status} {_REASONS[status]}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    ).encode()
    return head + body


class ConnectionLimits:
    """Our limits on top of a uvicorn HTTP protocol: a client must complete each request
    head within `header_timeout` seconds of its first byte (or of connecting) and within
    `max_header_bytes`, at most `max_connections` connections are served, and a malformed
    request gets a JSON 400 instead of plain text. A connection beyond the limit takes the
    place of the one idle longest (no request in progress; idle since it connected or its
    last response ended), so that clients holding sockets open cannot lock others out;
    where every connection is in a request, it gets a 503 and is closed."""

    header_timeout: float = 30.0
    max_connections: int | None = None
    max_header_bytes: int = 16 * 1024

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)  # type: ignore[misc]
        self._head_timer: asyncio.TimerHandle | None = None
        self._head_bytes = 0
        self._head_tail = b""  # the last bytes read of a head not yet complete
        self._idle_since = self.loop.time()  # type: ignore[attr-defined]
        over = self.max_connections is not None and (
            len(self.connections) > self.max_connections  # type: ignore[attr-defined]
        )
        idlest = self._idlest() if over else None
        if idlest is not None:
            idlest._refused = True  # its remaining reads are dropped
            idlest.transport.close()  # type: ignore[attr-defined]
        self._refused = over and idlest is None
        if self._refused:
            message = f"too many open connections (limit {self.max_connections}); retry later"
            transport.write(raw_error(503, message, "service_unavailable"))
            # Half-close and let the client close: closing with its request unread would
            # reset the connection and could lose the reply.
            if transport.can_write_eof():
                transport.write_eof()
            self._head_timer = self.loop.call_later(1.0, transport.close)  # type: ignore[attr-defined]
            return
        self._arm_head_timer()

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return  # read and dropped, so the client's close ends the connection cleanly
        if not self._in_request():  # counted before parsing: a whole head may come at once
            scan = self._head_tail + data  # the end of a head may straddle two reads
            end = scan.find(b"\r\n\r\n")
            self._head_bytes += len(data) if end < 0 else max(0, end + 4 - len(self._head_tail))
            self._head_tail = scan[-3:]
            if self._head_bytes > self.max_header_bytes:
                self.send_400_response("request head too large")
                return
        super().data_received(data)  # type: ignore[misc]
        if self._in_request():
            self._cancel_head_timer()
            self._head_bytes, self._head_tail = 0, b""
            return
        if self._head_timer is None:
            self._arm_head_timer()  # the first byte of a next request on a kept-alive connection

    def on_response_complete(self) -> None:
        """A kept-alive connection is idle from the end of its last response, not from the
        start of the request: a long stream that just ended is not the idlest."""
        self._idle_since = self.loop.time()  # type: ignore[attr-defined]
        super().on_response_complete()  # type: ignore[misc]

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_timer()
        super().connection_lost(exc)  # type: ignore[misc]

    def send_400_response(self, msg: str) -> None:
        message = (
            "invalid HTTP request: malformed request line, header or Content-Length, or a "
            f"request head over {self.max_header_bytes} bytes"
        )
        self.transport.write(raw_error(400, message, "invalid_request_error"))  # type: ignore[attr-defined]
        self.transport.close()  # type: ignore[attr-defined]

    def _idlest(self) -> ConnectionLimits | None:
        """The other served connection idle longest, if any is idle."""
        idle = [
            other
            for other in self.connections  # type: ignore[attr-defined]
            if isinstance(other, ConnectionLimits)
            and other is not self
            and not other._refused
            and not other._in_request()
        ]
        return min(idle, key=lambda other: other._idle_since, default=None)

    def _in_request(self) -> bool:
        cycle = self.cycle  # type: ignore[attr-defined]
        return cycle is not None and not cycle.response_complete

    def _arm_head_timer(self) -> None:
        self._head_timer = self.loop.call_later(self.header_timeout, self._head_timed_out)  # type: ignore[attr-defined]

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if not self._in_request() and not self.transport.is_closing():  # type: ignore[attr-defined]
            self.transport.close()  # type: ignore[attr-defined]


def limited_protocol(
    header_timeout: float, max_connections: int | None, max_header_bytes: int
) -> type:
    """uvicorn's fastest HTTP protocol available (httptools, else h11) with our limits."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as base
    except ImportError:
        from uvicorn.protocols.http.h11_impl import H11Protocol as base
    return type(
        "ServerProtocol",
        (ConnectionLimits, base),
        {
            "header_timeout": header_timeout,
            "max_connections": max_connections,
            "max_header_bytes": max_header_bytes,
        },
    )


class DrainingServer(uvicorn.Server):
    """On SIGTERM/SIGINT: stop accepting, let running requests finish for `drain_timeout`
    seconds, then call `abort_all` so every stream ends with a final chunk and every
    waiting request gets an error reply; exit 0 (uvicorn would re-raise the signal)."""

    def __init__(
        self,
        config: uvicorn.Config,
        drain_timeout: float,
        abort_all: Callable[[], int],
        stop_signals: tuple[signal.Signals, ...] = (signal.SIGINT, signal.SIGTERM),
        announce: bool = True,
    ) -> None:
        super().__init__(config)
        self.drain_timeout = drain_timeout
        self.abort_all = abort_all
        self.stop_signals = stop_signals
        self.announce = announce

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        # uvicorn only announces sockets it bound itself
        if sockets and self.started and self.announce:
            host, port = sockets[0].getsockname()[:2]
            logger.info("serving on http://%s:%d (CTRL+C or SIGTERM to stop)", host, port)

    async def shutdown(self, sockets=None) -> None:
        deadline = asyncio.ensure_future(self._abort_after_timeout())
        try:
            await super().shutdown(sockets)
        finally:
            deadline.cancel()

    async def _abort_after_timeout(self) -> None:
        await asyncio.sleep(self.drain_timeout)
        aborted = self.abort_all()
        if aborted:
            logger.warning(
                "shutdown: %d request(s) still running after %g s (--shutdown-timeout); "
                "aborting them",
                aborted,
                self.drain_timeout,
            )

    @contextlib.contextmanager
    def capture_signals(self):
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in self.stop_signals}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
