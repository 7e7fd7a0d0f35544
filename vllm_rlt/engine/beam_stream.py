"""Beam search on the asynchronous engine, for the server's `use_beam_search`: one prompt's
search as a stream that yields a single final RequestOutput, whose completions are the best
beams (as vLLM's served beam search answers). Each step's beams run as requests of their
own; closing the stream aborts the step in flight and starts no other, so a client that
leaves frees its blocks at once. A step aborted from outside (shutdown, a pause that
aborts) ends the search: its beams so far come back with finish reason "abort"."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import replace

from vllm_rlt.beam_search import BeamSearchParams, BeamSearchSequence
from vllm_rlt.engine.async_llm import AsyncLLM, QueueFullError
from vllm_rlt.engine.beam_search import BeamSearch, beam_limits
from vllm_rlt.engine.request_stream import RequestStream, final_output
from vllm_rlt.logprobs import Logprob
from vllm_rlt.outputs import CompletionOutput, RequestMetrics, RequestOutput
from vllm_rlt.sampling_params import RequestOutputKind, SamplingParams

QUEUE_POLL_S = 0.01  # how often a search admitted earlier looks for room in a full queue


class BeamStream:
    """The search of `prompt_ids` under `beam`; `shown` is the request's own sampling, for
    what the output shows: its logprobs (the token and the top N of each step's ranking)
    and how its texts are decoded."""

    def __init__(
        self,
        engine: AsyncLLM,
        request_id: str,
        prompt: str | None,
        prompt_ids: list[int],
        beam: BeamSearchParams,
        shown: SamplingParams,
        halted: Callable[[], bool] = lambda: False,
    ) -> None:
        self.engine = engine
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_ids = prompt_ids
        self.beam = beam
        self.shown = shown
        self.search = BeamSearch([prompt_ids], beam, beam_limits(engine.processor))
        self.step_params = replace(
            self.search.step_params, output_kind=RequestOutputKind.FINAL_ONLY
        )
        self.halted = halted  # the server is shutting down: no step starts
        self._closed = False
        self._pauses = engine.pause.aborts  # a later aborting pause ends the search
        self._running: list[RequestStream] = []
        self._arrival = time.monotonic()

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._outputs()

    def close(self) -> None:
        """End the search: the step in flight is aborted, and no other starts."""
        self._closed = True
        self._abort_step()

    def _abort_step(self) -> None:
        running, self._running = self._running, []
        for stream in running:
            stream.close()

    async def _outputs(self) -> AsyncIterator[RequestOutput]:
        step = 0
        while not (aborted := self._stopped()) and (batch := self.search.batch()):
            try:
                if not await self._open_step(step, batch):  # stopped while waiting for room
                    aborted = True
                    break
                tasks = [asyncio.ensure_future(final_output(one)) for one in self._running]
                try:
                    results = await asyncio.gather(*tasks)
                finally:  # one failed, or the reader left: no sibling is left waiting
                    for task in tasks:
                        task.cancel()
            finally:
                self._abort_step()
            if aborted := any(_aborted(result) for result in results):  # shutdown, pause
                break
            self.search.advance(results)
            step += 1
        # ended from outside: the unfinished beams of the last whole step end as an aborted
        # request ends
        beams = self.search.outputs("abort" if aborted else "length")[0].sequences
        yield self._output(beams)

    async def _open_step(self, step: int, batch: list[list[int]]) -> bool:
        """Queue the step's requests (each opened one is closed by the caller). A full queue
        is waited out, not answered with 429: the search was admitted (the server checked
        its n beams' room) and holds no slot between steps. False: the search was stopped
        while it waited."""
        attempt = 0  # in the ids: a request aborted on a full queue may linger under its own
        while True:
            try:
                for i, ids in enumerate(batch):
                    request_id = f"{self.request_id}-beam{step}-{attempt}-{i}"
                    self._running.append(self.engine.add_request(request_id, ids, self.step_params))
                return True
            except QueueFullError:
                self._abort_step()
            await asyncio.sleep(QUEUE_POLL_S)
            if self._stopped():
                return False
            attempt += 1

    def _stopped(self) -> bool:
        return self._closed or self.halted() or self.engine.pause.aborts != self._pauses

    def _output(self, beams: list[BeamSearchSequence]) -> RequestOutput:
        completions = [self._completion(index, beam) for index, beam in enumerate(beams)]
        depths = [depth for beam in beams[:1] for depth in beam.exit_depths[1:]]
        now = time.monotonic()
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_ids,
            outputs=completions,
            finished=True,
            metrics=RequestMetrics.of(self._arrival, now, now, depths),
            weight_version=self.engine.weight_version,
        )

    def _completion(self, index: int, beam: BeamSearchSequence) -> CompletionOutput:
        """A beam as a choice: its text without the EOS token that ended it (unless
        include_stop_str_in_output), its logprobs cut to what the request asked."""
        ids = beam.token_ids
        text_ids = ids[:-1] if beam.finish_reason == "stop" else ids
        if self.beam.include_stop_str_in_output:
            text_ids = ids
        tokenizer = self.engine.processor.tokenizer
        text = ""
        if tokenizer is not None:
            text = tokenizer.decode(
                text_ids,
                skip_special_tokens=self.shown.skip_special_tokens,
                spaces_between_special_tokens=self.shown.spaces_between_special_tokens,
            )
        wanted = self.shown.logprobs
        logprobs = None
        if wanted is not None:
            steps = zip(beam.logprobs, ids, strict=True)
            logprobs = [_top(step, token, wanted) for step, token in steps]
        return CompletionOutput(
            index=index,
            text=text,
            token_ids=ids,
            exit_depths=beam.exit_depths,
            logprobs=logprobs,
            finish_reason=beam.finish_reason,
            cumulative_logprob=beam.cum_logprob,
        )


def _aborted(output: RequestOutput) -> bool:
    return any(completion.finish_reason == "abort" for completion in output.outputs)


def _top(ranked: dict[int, Logprob], token: int, wanted: int) -> dict[int, Logprob]:
    """The chosen token's entry and the `wanted` best ranked of its step."""
    best = sorted(ranked.items(), key=lambda item: -item[1].logprob)[:wanted]
    return {token: ranked[token], **dict(best)}
