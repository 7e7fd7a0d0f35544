"""Requests the frontend keeps back from the engine cores for a while, in order, and what a
caller asks of them meanwhile. A pause keeps every new request until it ends
(engine/rl_calls.py). A request whose id is that of a stream its reader left waits until the
core has answered that stream's abort (AsyncLLM): so one id never has two requests in the
cores, where with several cores the two could run on different ones and each one's deltas
reach the other's stream."""

from __future__ import annotations

from collections.abc import Callable

from vllm_rlt.engine.process.messages import AbortRequest, AddRequest
from vllm_rlt.engine.request_stream import RequestStream

Held = AddRequest | AbortRequest


class HeldCommands:
    """Commands kept back, in the order they came."""

    def __init__(self) -> None:
        self.commands: list[Held] = []

    def ids(self) -> set[str]:
        """The requests held here."""
        return {c.request_id for c in self.commands if isinstance(c, AddRequest)}

    def hold(self, command: Held) -> None:
        self.commands.append(command)

    def drop(self, request_id: str, index: int | None, stream: RequestStream | None) -> bool:
        """Abort a request held here (True; False: it is not held). A whole request leaves
        at once, its `stream` ended with finish reason abort; one completion's abort is kept
        to follow the request."""
        if request_id not in self.ids():
            return False
        if index is not None:
            self.commands.append(AbortRequest(request_id, index))
            return True
        self.commands = [c for c in self.commands if c.request_id != request_id]
        if stream is not None:
            stream.end_unsent()
        return True

    def drop_all(self, stream_of: Callable[[str], RequestStream | None]) -> None:
        """Abort every request held here."""
        for request_id in self.ids():
            self.drop(request_id, None, stream_of(request_id))

    def take(self, request_id: str | None = None) -> list[Held]:
        """The commands held (those of `request_id` alone, if given), in order; they are no
        longer held."""
        taken = [c for c in self.commands if request_id in (None, c.request_id)]
        self.commands = [c for c in self.commands if request_id not in (None, c.request_id)]
        return taken
