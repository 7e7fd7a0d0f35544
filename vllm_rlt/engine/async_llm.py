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

from vllm_rlt.config import require
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


class RequestFailedError(RuntimeError):
    """The engine failed this request alone; other requests and the engine are unaffected."""


@dataclass(frozen=True)
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    prompt: str | None


@dataclass(frozen=True)
class _Abort:
    request_id: str
    index: int | None  # one completion of the request, or all of them


@dataclass(frozen=True)
class _AbortAll:
    pass


class TextStage:
    """Turns one request's token outputs into text on the caller's thread, so the engine
    thread never detokenizes; a stop string ends its completion here (the engine is then
    told to abort that completion)."""

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int], params) -> None:
        self.params = params
        self.trackers = [
            TextTracker(tokenizer, prompt_token_ids, params.stop, params.include_stop_str_in_output)
            for _ in range(params.n)
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


class RequestStream:
    """One request's cumulative outputs, in order, as an async iterator. It is queued the
    moment it is opened; `close()` (which every opener must call) aborts it unless the
    engine finished it, so a caller that leaves frees its slot and blocks at once."""

    def __init__(self, owner: AsyncLLM, request_id: str, params: SamplingParams, stage) -> None:
        self.owner = owner
        self.request_id = request_id
        self.params = params
        self.stage: TextStage | None = stage
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()
        self.finished = False  # the caller has seen the last output
        self.engine_done = False  # the engine holds nothing of this request any more
        self.closed = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self.queue.get()
        if isinstance(item, BaseException):
            self.finished = self.engine_done = True
            raise item
        if item.error is not None:
            self.finished = self.engine_done = True
            raise RequestFailedError(f"request failed in the engine: {item.error}")
        self.engine_done = item.finished
        if self.stage is not None:
            item, stopped = self.stage.apply(item)
            for index in stopped:
                self.owner.abort(self.request_id, index)
        self.finished = item.finished
        return item

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.owner._release(self)


class AsyncLLM:
    """Owns `engine` on a dedicated thread. Nothing here blocks the caller's event loop.

    `max_waiting` bounds the sequences (completions) that wait for a slot: a request is
    refused when it would raise the sequences in the engine above `max_num_seqs +
    max_waiting`, and refused for good when it alone exceeds that.
    """

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
        self.max_running = engine.scheduler.config.max_num_seqs
        self.on_step = on_step
        self.dead: BaseException | None = None
        self.last_progress = time.monotonic()
        self.num_sequences = 0  # completions of the open streams (caller's thread)
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, RequestStream] = {}
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="vllm-rlt-engine", daemon=True)
        self._thread.start()

    # ----------------------------------------------------------------- caller side
    @property
    def has_work(self) -> bool:
        return bool(self._streams)

    @property
    def num_requests(self) -> int:
        """Requests whose streams are open (queued or running)."""
        return len(self._streams)

    def check_capacity(self, sequences: int) -> None:
        """Refuse `sequences` more completions: for good (ParamError) when they could never
        fit, for now (QueueFullError) when the queue is full."""
        if self.max_waiting is None:
            return
        capacity = self.max_running + self.max_waiting
        require(
            sequences <= capacity,
            f"the request needs {sequences} sequences (prompts x n) but the server holds at "
            f"most {capacity}: {self.max_running} running (--max-num-seqs) and "
            f"{self.max_waiting} waiting (--max-queue)",
            "n",
        )
        if self.num_sequences + sequences > capacity:
            raise QueueFullError(
                f"the waiting queue is full ({self.max_waiting} sequences wait for "
                f"{self.max_running} slots); retry later"
            )

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt: str | None = None,
    ) -> RequestStream:
        """Queue a request now and return its stream (call it from the event loop)."""
        if self.dead is not None:
            raise EngineDeadError(f"engine stopped: {self.dead!r}")
        require(request_id not in self._streams, f"request_id {request_id!r} is already in use")
        self.check_capacity(params.n)
        stage = None
        if self.tokenizer is not None:
            stage = TextStage(self.tokenizer, prompt_token_ids, params)
        stream = RequestStream(self, request_id, params, stage)
        self._streams[request_id] = stream
        self.num_sequences += params.n
        self._send(_Add(request_id, prompt_token_ids, params, prompt))
        return stream

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream cumulative outputs of one request; leaving early aborts it."""
        stream = self.add_request(request_id, prompt_token_ids, params, prompt)
        try:
            async for output in stream:
                yield output
        finally:
            stream.close()

    def abort(self, request_id: str, index: int | None = None) -> None:
        """Abort a request, or only its completion `index`."""
        self._send(_Abort(request_id, index))

    def abort_all(self) -> None:
        """End every request now: each stream gets a final output with finish reason abort."""
        self._send(_AbortAll())

    def shutdown(self) -> None:
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout=10)

    def _send(self, command: _Add | _Abort | _AbortAll) -> None:
        self._commands.put(command)
        self._wake.set()

    def _release(self, stream: RequestStream) -> None:
        if self._streams.get(stream.request_id) is stream:
            del self._streams[stream.request_id]
            self.num_sequences -= stream.params.n
        if not stream.engine_done:
            self.abort(stream.request_id)

    # ----------------------------------------------------------------- engine thread
    def _run(self) -> None:
        engine = self.engine
        try:
            while not self._stopping:
                self._take_commands()
                if not engine.has_unfinished:
                    self._wake.wait(0.05)
                    self._wake.clear()
                    self.last_progress = time.monotonic()
                    continue
                outputs = engine.step()
                self.last_progress = time.monotonic()
                self._observe(outputs)
                for output in outputs:
                    self._deliver(output.request_id, output)
        except BaseException as exc:  # a broken pass leaves device state unknown
            logger.exception("the engine stopped after an error; restart the server")
            self.dead = exc
            self._fail_all(EngineDeadError(f"engine stopped: {exc!r}"))
            return
        for request_id in list(engine.groups):
            engine.abort_request(request_id)

    def _take_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(command, _Add):
                if command.request_id not in self._streams:
                    continue  # the caller left before the engine saw the request
                try:
                    self.engine.add_request(
                        command.request_id,
                        command.prompt_token_ids,
                        command.params,
                        prompt=command.prompt,
                    )
                except Exception as exc:  # noqa: BLE001 - fails this request only
                    self._deliver(command.request_id, exc)
            elif isinstance(command, _Abort):
                output = self.engine.abort_request(command.request_id, command.index)
                if output is not None:
                    self._observe([output])
            else:
                for request_id in list(self.engine.groups):
                    output = self.engine.abort_request(request_id)
                    if output is not None:
                        self._observe([output])
                        self._deliver(request_id, output)

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
        if stream is None:
            return
        try:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)
        except RuntimeError:  # the caller's event loop has closed: nobody is listening
            pass

    def _fail_all(self, error: BaseException) -> None:
        for request_id in list(self._streams):
            self._deliver(request_id, error)
