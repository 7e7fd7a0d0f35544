"""One request's stream in the frontend: the tokens the core sends for it, turned into
text (and checked for stop strings) on the event loop's thread, and handed to its reader
as cumulative outputs."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field, replace
from typing import Protocol

from vllm_rlt.config import ParamError
from vllm_rlt.engine.messages import RequestDelta
from vllm_rlt.engine.output_processor import TextTracker
from vllm_rlt.outputs import CompletionOutput, RequestMetrics, RequestOutput
from vllm_rlt.sampling_params import SamplingParams
from vllm_rlt.tokenizer import Tokenizer


class StreamOwner(Protocol):
    """What a stream needs of the frontend that opened it (AsyncLLM)."""

    tokenizer: Tokenizer | None

    def abort(self, request_id: str, index: int | None = None) -> None: ...

    def observe_finished(self, output: RequestOutput) -> None: ...

    def release(self, stream: RequestStream) -> None: ...


class RequestFailedError(RuntimeError):
    """The engine failed this request alone; other requests and the engine are unaffected."""


class TextStage:
    """Turns one request's token outputs into text on the caller's thread, so the engine
    thread never detokenizes; a stop string ends its completion here (the engine is then
    told to abort that completion)."""

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int], params) -> None:
        self.params = params
        self.trackers = [
            TextTracker(
                tokenizer,
                prompt_token_ids,
                params.stop,
                params.include_stop_str_in_output,
                params.skip_special_tokens,
                params.spaces_between_special_tokens,
            )
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


@dataclass
class _Completion:
    """One completion's tokens so far, as the core sent them."""

    token_ids: list[int] = field(default_factory=list)
    exit_depths: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None


class RequestStream:
    """One request's cumulative outputs, in order, as an async iterator. It is queued the
    moment it is opened; `close()` (which every opener must call) aborts it unless the
    engine finished it, so a caller that leaves frees its slot and blocks at once."""

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
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        tokenizer = owner.tokenizer
        self.stage = None if tokenizer is None else TextStage(tokenizer, prompt_token_ids, params)
        self.loop = asyncio.get_running_loop()
        self.completions = [_Completion() for _ in range(params.n)]
        self.arrival_time = time.monotonic()
        self.first_token_time: float | None = None
        self.finished_time: float | None = None
        self.failure: BaseException | None = None
        self.prompt_logprobs: list[dict[int, float] | None] | None = None
        self.fresh = False  # the core sent something the caller has not read
        self.waiter: asyncio.Future | None = None
        self.finished = False  # the caller has seen the last output
        self.engine_done = False  # the engine holds nothing of this request any more
        self.closed = False

    # ----------------------------------------------------------------- event loop side
    def absorb(self, delta: RequestDelta, now: float) -> None:
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        for part in delta.completions:
            completion = self.completions[part.index]
            completion.token_ids.extend(part.token_ids)
            completion.exit_depths.extend(part.exit_depths)
            if part.logprobs is not None and part.top_logprobs is not None:
                if completion.logprobs is None:
                    completion.logprobs, completion.cumulative_logprob = [], 0.0
                for token, chosen, top in zip(
                    part.token_ids, part.logprobs, part.top_logprobs, strict=True
                ):
                    entry = dict(top)
                    entry[token] = chosen
                    completion.logprobs.append(entry)
                    completion.cumulative_logprob += chosen  # type: ignore[operator]
            if part.finish_reason is not None:
                completion.finish_reason = part.finish_reason
            if part.token_ids and self.first_token_time is None:
                self.first_token_time = now
        if delta.error is not None:
            message = delta.error
            self.failure = (
                ParamError(message, delta.error_param)
                if delta.invalid
                else RequestFailedError(f"request failed in the engine: {message}")
            )
        if delta.finished:
            self.engine_done = True
            self.finished_time = now
        self._wake()

    def fail(self, error: BaseException) -> None:
        self.failure = error
        self.engine_done = True
        self._wake()

    def _wake(self) -> None:
        self.fresh = True
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        while not self.fresh:
            self.waiter = self.loop.create_future()
            await self.waiter
        self.fresh = False
        if self.failure is not None:
            self.finished = True
            raise self.failure
        output = self._snapshot()
        if self.stage is not None:
            output, stopped = self.stage.apply(output)
            for index in stopped:
                self.owner.abort(self.request_id, index)
        self.finished = output.finished
        if self.finished:
            if output.metrics.finished_time is None:  # a stop string ended it here
                output.metrics.finished_time = time.monotonic()
            self.owner.observe_finished(output)
        return output

    def _snapshot(self) -> RequestOutput:
        outputs = [
            CompletionOutput(
                index=index,
                text="",
                token_ids=list(c.token_ids),
                exit_depths=list(c.exit_depths),
                logprobs=None if c.logprobs is None else list(c.logprobs),
                finish_reason=c.finish_reason,
                cumulative_logprob=c.cumulative_logprob,
            )
            for index, c in enumerate(self.completions)
        ]
        depths = [d for c in self.completions for d in c.exit_depths[1:]]
        metrics = RequestMetrics.of(
            self.arrival_time, self.first_token_time, self.finished_time, depths
        )
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=outputs,
            finished=all(c.finish_reason is not None for c in self.completions),
            metrics=metrics,
            prompt_logprobs=self.prompt_logprobs,
        )

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.owner.release(self)
