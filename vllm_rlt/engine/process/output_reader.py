"""Reading an engine core's outputs on an asyncio event loop, and stopping that cleanly."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from typing import Any

import zmq
import zmq.asyncio

from vllm_rlt.engine.process.messages import EngineDead, EngineOutputs

logger = logging.getLogger(__name__)


class OutputReader:
    """The task that reads a core's output socket on the running event loop (started there)
    and hands each step's outputs to `on_outputs`; `heard` marks each one, `died` gets a
    core's dying words."""

    def __init__(
        self,
        output: zmq.Socket,
        decode: Callable[[Any], Any],
        on_outputs: Callable[[EngineOutputs], None],
        heard: Callable[[], None],
        died: Callable[[str], None],
    ) -> None:
        self.socket = zmq.asyncio.Socket.from_socket(output)
        self.loop = asyncio.get_running_loop()
        self.task = self.loop.create_task(self._read(decode, on_outputs, heard, died))

    async def _read(self, decode, on_outputs, heard, died) -> None:
        while True:
            message = decode(await self.socket.recv(copy=False))
            if isinstance(message, EngineOutputs):
                heard()
                try:
                    on_outputs(message)
                except Exception:  # noqa: BLE001 - a caller's bug must not stop the reader
                    logger.exception("handling engine outputs failed")
            elif isinstance(message, EngineDead):
                logger.error("engine stopped after an error:\n%s", message.traceback.rstrip())
                died(f"engine stopped: {message.message}")
                return

    def stop(self) -> None:
        """Cancel the task and take the socket off its loop, before the caller destroys the
        context: a registration left on the closed socket's descriptor hung the next
        engine's reader on that loop, which got the same descriptor number. From another
        thread, wait up to 5 s for the loop to do it."""

        def stop_here() -> None:
            self.task.cancel()
            self.socket.close(linger=0)

        try:
            here = asyncio.get_running_loop() is self.loop
        except RuntimeError:
            here = False
        if here:
            stop_here()
            return
        done = threading.Event()
        try:
            self.loop.call_soon_threadsafe(lambda: (stop_here(), done.set()))
        except RuntimeError:  # its event loop has closed, and the task with it
            return
        if self.loop.is_running():
            done.wait(5)
