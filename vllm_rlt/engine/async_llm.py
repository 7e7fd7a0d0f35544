"""AsyncLLM: one thread owns the EngineCore and runs passes back to back; asyncio callers
submit requests and cancellations through a queue and receive outputs as they come."""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace

from vllm_rlt.engine.engine_core import EngineCore
from vllm_rlt.engine.output_processor import TextTracker
from vllm_rlt.outputs import CompletionOutput, RequestOutput
from vllm_rlt.sampling_params import SamplingParams
from vllm_rlt.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine thread stopped after an error; no request can run any more."""


class QueueFullError(RuntimeError):
    """The bounded waiting queue is full."""


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue


class TextStage:
    """Turns one request's token outputs into text on the caller's thread, so the engine
    thread never detokenizes; a stop string ends its completion here (the engine is then
    told to abort that completion)."""

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int], params) -> None:
        self.params = params
        self.trackers = [
            TextTracker(tokenizer, prompt_token_ids, params.stop) for _ in range(params.n)
        ]
        self.seen = [0] * params.n
        self.cut: list[int | None] = [None] * params.n  # token count where a stop string hit

    def apply(self, output: RequestOutput) -> tuple[RequestOutput, list[int]]:
        """The output with text filled in, and the completions a stop string just ended."""
        newly_stopped, completions = [], []
        for completion in output.outputs:
            i = completion.index
            tracker = self.trackers[i]
            while self.cut[i] is None and self.seen[i] < len(completion.token_ids):
                self.seen[i] += 1
                check = self.seen[i] >= self.params.min_tokens
                if tracker.add(completion.token_ids[self.seen[i] - 1], check):
                    self.cut[i] = self.seen[i]
                    newly_stopped.append(i)
            completions.append(self._completion(completion, tracker, self.cut[i]))
        finished = all(c.finish_reason is not None for c in completions)
        return replace(output, outputs=completions, finished=finished), newly_stopped

    @staticmethod
    def _completion(completion: CompletionOutput, tracker: TextTracker, cut: int | None):
        if cut is None:
            ended = completion.finish_reason is not None
            return replace(completion, text=tracker.final_text() if ended else tracker.text)
        return replace(
            completion,
            text=tracker.text,
            token_ids=completion.token_ids[:cut],
            exit_depths=completion.exit_depths[:cut],
            logprobs=None if completion.logprobs is None else completion.logprobs[:cut],
            finish_reason="stop",
        )


class AsyncLLM:
    """Owns `engine` on a dedicated thread. Nothing here blocks the caller's event loop."""

    def __init__(
        self,
        engine: EngineCore,
        max_waiting: int | None = None,
        on_step: Callable[[EngineCore, list[RequestOutput]], None] | None = None,
        tokenizer: Tokenizer | None = None,
    ) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        if tokenizer is not None:
            engine.leave_text_to_caller()
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
        stage = None
        if self.tokenizer is not None:
            stage = TextStage(self.tokenizer, prompt_token_ids, params)
        finished = engine_finished = False
        try:
            while not finished:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                engine_finished = item.finished
                if stage is not None:
                    item, stopped = stage.apply(item)
                    for index in stopped:
                        self.abort(request_id, index)
                finished = item.finished
                yield item
        finally:
            self._streams.pop(request_id, None)
            if not engine_finished:
                self.abort(request_id)

    def abort(self, request_id: str, index: int | None = None) -> None:
        """Abort a request, or only its completion `index`."""
        self._commands.put(("abort", request_id, index))
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
            self._observe(outputs)
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
                except Exception as exc:  # noqa: BLE001 - fails this request only
                    self._deliver(request_id, exc)
            else:
                output = self.engine.abort_request(command[1], command[2])
                if output is not None:
                    self._observe([output])

    def _observe(self, outputs: list[RequestOutput]) -> None:
        """Report to the observer (metrics); its failure must not stop the engine."""
        if self.on_step is None:
            return
        try:
            self.on_step(self.engine, outputs)
        except Exception:  # noqa: BLE001
            logger.exception("step observer failed; the engine keeps running")

    def _deliver(self, request_id: str, item: RequestOutput | BaseException) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)

    def _fail_all(self, error: BaseException) -> None:
        for request_id in list(self._streams):
            self._deliver(request_id, error)
