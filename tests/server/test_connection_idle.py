"""Which kept-alive connection counts as idle longest, with uvicorn's own protocol on an
event loop whose clock the test sets: no timing depends on the machine's speed."""

from __future__ import annotations

import asyncio

import pytest
import uvicorn
from uvicorn.server import ServerState

from vllm_rlt.entrypoints.openai.connection import limited_protocol

REQUEST = b"GET /%s HTTP/1.1\r\nhost: x\r\n\r\n"


class FakeTransport(asyncio.Transport):
    """What the protocol writes, and whether it closed the connection."""

    def __init__(self) -> None:
        super().__init__()
        self.written = b""
        self.closed = False

    def get_extra_info(self, name, default=None):
        return {"peername": ("127.0.0.1", 40000), "sockname": ("127.0.0.1", 8000)}.get(
            name, default
        )

    def write(self, data) -> None:
        self.written += bytes(data)

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    def can_write_eof(self) -> bool:
        return True

    def write_eof(self) -> None:
        pass

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


class Clock:
    """The event loop's time: only the test moves it."""

    now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clocked_loop():
    loop = asyncio.SelectorEventLoop()  # a pure-Python loop: its clock can be replaced
    clock = Clock()
    loop.time = clock  # type: ignore[method-assign]
    yield loop, clock
    loop.close()


def test_a_connection_is_idle_from_the_end_of_its_last_response(clocked_loop):
    """A streamed the whole time B sat idle, and finished after B connected: beyond the
    limit, B (idle longer) makes room, not A."""
    loop, clock = clocked_loop
    finish_stream = asyncio.Event()

    async def app(scope, receive, send) -> None:
        if scope["type"] != "http":
            return
        await send({"type": "http.response.start", "status": 200, "headers": []})
        if scope["path"] == "/stream":
            await send({"type": "http.response.body", "body": b"first", "more_body": True})
            await finish_stream.wait()
        await send({"type": "http.response.body", "body": b"last"})

    config = uvicorn.Config(app, log_config=None, timeout_keep_alive=1000, lifespan="off")
    protocol = limited_protocol(header_timeout=1000, max_connections=2, max_header_bytes=8192)
    state = ServerState()

    def connect() -> tuple[asyncio.Protocol, FakeTransport]:
        connection, transport = protocol(config, state, {}, _loop=loop), FakeTransport()
        connection.connection_made(transport)
        return connection, transport

    def settle() -> None:
        for _ in range(10):
            loop.run_until_complete(asyncio.sleep(0))

    stream, stream_transport = connect()  # t = 0
    clock.now = 1.0
    stream.data_received(REQUEST % b"stream")
    settle()
    assert stream_transport.written.endswith(b"first\r\n")  # streaming, not finished
    clock.now = 2.0
    idle, idle_transport = connect()
    clock.now = 10.0
    finish_stream.set()
    settle()
    assert stream_transport.written.endswith(b"0\r\n\r\n")  # the stream has ended
    clock.now = 11.0
    _, newcomer_transport = connect()  # one over the limit
    assert idle_transport.closed and not stream_transport.closed
    assert not newcomer_transport.closed and newcomer_transport.written == b""
