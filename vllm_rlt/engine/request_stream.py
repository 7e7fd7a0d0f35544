"""One request's stream in the frontend: the core's deltas for it go through its
`RequestState` (text, stop strings) on the event loop's thread, and its reader gets
outputs in the request's output kind."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterable
from typing import Protocol

from vllm_rlt.engine.core_outputs import CompletionDelta, RequestDelta
from vllm_rlt.engine.output_processor import RequestState
from vllm_rlt.outputs import RequestOutput
from vllm_rlt.sampling_params import SamplingParams
from vllm_rlt.tokenizer import Tokenizer


class StreamOwner(Protocol):
    """What a stream needs of the frontend that opened it (AsyncLLM)."""

    tokenizer: Tokenizer | None

    weight_version: str | None

    def abort(self, request_id: str, index: int | None = None) -> None: ...

    def observe_finished(self, output: RequestOutput) -> None: ...

    def release(self, stream: RequestStream) -> None: ...


class RequestStream:
    """One request's outputs, in order, as an async iterator. It is queued the moment it is
    opened; `close()` (which every opener must call) aborts it unless the engine finished
    it, so a caller that leaves frees its slot and blocks at once. A reader slower than the
    engine gets what arrived in between as one output."""

    def __init__(
        self,
        owner: StreamOwner,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
    ) -> None:
        self.owner = owner
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.state = RequestState(
            request_id, prompt, prompt_token_ids, params, owner.tokenizer, time.monotonic()
        )
        self.loop = asyncio.get_running_loop()
        self.failure: BaseException | None = None
        self.fresh = False  # the core sent something the caller has not read
        self.waiter: asyncio.Future | None = None
        self.finished = False  # the caller has seen the last output
        self.closed = False
        self.weight_version: str | None = None  # the owner's when the last delta came

    @property
    def engine_done(self) -> bool:
        """The engine holds nothing of this request any more."""
        return self.state.engine_done

    # ----------------------------------------------------------------- event loop side
    def absorb(self, delta: RequestDelta, now: float) -> None:
        """Take in one delta; a failure here fails this request alone."""
        state = self.state
        self.weight_version = self.owner.weight_version
        try:
            for index in state.absorb(delta, now):  # ended by a stop string
                self.owner.abort(self.request_id, index)
        except Exception as exc:  # noqa: BLE001 - fails this request only
            state.fail(exc, now)
            self.owner.abort(self.request_id)
        if state.failure is not None:
            self.failure = state.failure
        self._wake()

    def end_unsent(self) -> None:
        """End a request that never reached a core: each completion with finish reason
        abort."""
        ended = [
            CompletionDelta(
                index=i,
                start=0,
                token_ids=[],
                exit_depths=[],
                logprobs=None,
                top_logprobs=None,
                finish_reason="abort",
            )
            for i in range(self.params.n)
        ]
        self.absorb(RequestDelta(self.request_id, ended, True), time.monotonic())

    def fail(self, error: BaseException) -> None:
        self.failure = error
        self.state.engine_done = True
        self._wake()

    def _wake(self) -> None:
        self.fresh = True
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        while True:
            if self.finished:
                raise StopAsyncIteration
            while not self.fresh:
                self.waiter = self.loop.create_future()
                await self.waiter
            self.fresh = False
            if self.failure is not None:
                self.finished = True
                raise self.failure
            output = self.state.output()
            if self.state.finished:
                self.finished = True
                self.owner.observe_finished(self.state.final_output())
            if output is not None:
                output.weight_version = self.weight_version
                return output

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if not self.finished:  # its reader left (a client gone): counted as aborted
            self.finished = True
            self.state.abandon(time.monotonic())
            self.owner.observe_finished(self.state.final_output())
        self.owner.release(self)


async def final_output(stream: AsyncIterable[RequestOutput]) -> RequestOutput:
    """The last output of a stream opened for FINAL_ONLY (its only one)."""
    final = None
    async for output in stream:
        final = output
    assert final is not None
    return final
