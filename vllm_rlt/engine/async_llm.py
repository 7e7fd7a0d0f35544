"""AsyncLLM: one thread owns the EngineCore and runs passes back to back; asyncio callers
submit requests and cancellations through a queue and receive outputs as they come."""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from vllm_rlt.engine.engine_core import EngineCore
from vllm_rlt.outputs import RequestOutput
from vllm_rlt.sampling_params import SamplingParams


class EngineDeadError(RuntimeError):
    """The engine thread stopped after an error; no request can run any more."""


class QueueFullError(RuntimeError):
    """The bounded waiting queue is full."""


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue


class AsyncLLM:
    """Owns `engine` on a dedicated thread. Nothing here blocks the caller's event loop."""

    def __init__(
        self,
        engine: EngineCore,
        max_waiting: int | None = None,
        on_step: Callable[[EngineCore, list[RequestOutput]], None] | None = None,
    ) -> None:
        self.engine = engine
        self.max_waiting = max_waiting
        self.on_step = on_step
        self.dead: BaseException | None = None
        self.last_progress = time.monotonic()
        self.num_waiting = 0  # requests not yet admitted, as last seen by the engine thread
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, _Stream] = {}
        self._submitted = 0  # adds sent but not yet taken by the engine thread
        self._lock = threading.Lock()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="vllm-rlt-engine", daemon=True)
        self._thread.start()

    # ----------------------------------------------------------------- caller side
    @property
    def has_work(self) -> bool:
        return bool(self._streams)

    def waiting(self) -> int:
        with self._lock:
            return self.num_waiting + self._submitted

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream cumulative outputs of one request; leaving early aborts it."""
        if self.dead is not None:
            raise EngineDeadError(f"engine stopped: {self.dead!r}")
        self.engine.check_request(request_id, prompt_token_ids, params)
        if self.max_waiting is not None and self.waiting() >= self.max_waiting:
            raise QueueFullError(f"the waiting queue is full ({self.max_waiting} requests)")
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        self._streams[request_id] = stream
        with self._lock:
            self._submitted += 1
        self._commands.put(("add", request_id, prompt_token_ids, params, prompt))
        self._wake.set()
        finished = False
        try:
            while not finished:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))
        self._wake.set()

    def shutdown(self) -> None:
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout=10)

    # ----------------------------------------------------------------- engine thread
    def _run(self) -> None:
        engine = self.engine
        while not self._stopping:
            self._take_commands()
            if not engine.has_unfinished:
                self._wake.wait(0.05)
                self._wake.clear()
                self.last_progress = time.monotonic()
                continue
            try:
                outputs = engine.step()
            except BaseException as exc:  # a broken pass leaves device state unknown
                self.dead = exc
                self._fail_all(EngineDeadError(f"engine stopped: {exc!r}"))
                return
            self.last_progress = time.monotonic()
            with self._lock:
                self.num_waiting = len(engine.scheduler.waiting)
            if self.on_step is not None:
                self.on_step(engine, outputs)
            for output in outputs:
                self._deliver(output.request_id, output)
        for request_id in list(engine.groups):
            engine.abort_request(request_id)

    def _take_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if command[0] == "add":
                _, request_id, ids, params, prompt = command
                with self._lock:
                    self._submitted -= 1
                if request_id not in self._streams:
                    continue  # the caller left before the engine saw the request
                try:
                    self.engine.add_request(request_id, ids, params, prompt=prompt)
                except ValueError as exc:
                    self._deliver(request_id, exc)
            else:
                output = self.engine.abort_request(command[1])
                if output is not None and self.on_step is not None:
                    self.on_step(self.engine, [output])

    def _deliver(self, request_id: str, item: RequestOutput | BaseException) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)

    def _fail_all(self, error: BaseException) -> None:
        for request_id in list(self._streams):
            self._deliver(request_id, error)
