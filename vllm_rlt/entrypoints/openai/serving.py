"""Completions and chat completions: jobs (built by request_jobs.py) run on the engine,
answered whole or as SSE events (shaped by response_shapes.py)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

import orjson

from vllm_rlt.engine.async_llm import EngineDeadError, QueueFullError
from vllm_rlt.engine.beam_stream import BeamStream
from vllm_rlt.engine.output_processor import RequestFailedError
from vllm_rlt.engine.request_stream import RequestStream, final_output
from vllm_rlt.entrypoints.openai.api_errors import APIError, as_api_error
from vllm_rlt.entrypoints.openai.request_jobs import RequestJobs
from vllm_rlt.entrypoints.openai.response_shapes import Job, ResponseShapes, shown
from vllm_rlt.outputs import RequestOutput
from vllm_rlt.sampling_params import RequestOutputKind

# A non-streamed body of more tokens and logprob entries than this is built on a worker
# thread (a thread hop costs about what building this many on the event loop does).
INLINE_ENTRIES = 2048


class OpenAIServing:
    """The served model's side of the completion routes: requests made into jobs (`jobs`),
    and jobs run on the engine."""

    def __init__(self, jobs: RequestJobs, request_timeout: float | None) -> None:
        self.jobs = jobs
        self.engine = jobs.engine
        self.request_timeout = request_timeout
        self.closing = False  # shutting down: new requests get 503, aborted ones too
        self.shapes = ResponseShapes(jobs.engine, jobs.tokenizer, jobs.model_name)

    def _open(self, job: Job, kind: RequestOutputKind) -> list[RequestStream | BeamStream]:
        """Queue the job's requests (all or none) and return their streams, whose outputs
        take the form `kind` (a beam search's: its one final output)."""
        engine = self.engine
        if self.closing:
            raise APIError(503, "the server is shutting down", "service_unavailable")
        if engine.dead is not None:
            raise APIError(503, "the engine has stopped after an error", "service_unavailable")
        try:
            engine.check_capacity(len(job.prompts) * job.params.n)
        except (QueueFullError, ValueError) as exc:
            raise as_api_error(exc) from exc
        params = replace(job.params, output_kind=kind)
        if job.beam is not None:
            return [
                BeamStream(
                    engine,
                    f"{job.engine_id}-{index}",
                    text,
                    ids,
                    job.beam,
                    params,
                    halted=lambda: self.closing,
                )
                for index, (text, ids) in enumerate(job.prompts)
            ]
        return [
            engine.add_request(f"{job.engine_id}-{index}", ids, params, prompt=text)
            for index, (text, ids) in enumerate(job.prompts)
        ]

    def _shutdown_error(self) -> APIError:
        return APIError(
            503, "the server shut down before the request finished", "service_unavailable"
        )

    async def run(self, job: Job) -> bytes:
        """Non-streaming: the whole response body, as JSON. A large one (many tokens, or
        logprobs for each) is built and rendered on a worker thread, so that it does not
        hold up every other client's stream for the seconds it can take."""
        finals = await self._finals(job)

        def render() -> bytes:
            return orjson.dumps(self._body(job, finals))

        if _entries(job, finals) <= INLINE_ENTRIES:
            return render()
        return await asyncio.to_thread(render)

    async def _finals(self, job: Job) -> list[RequestOutput]:
        """Each prompt's finished output."""
        streams = self._open(job, RequestOutputKind.FINAL_ONLY)

        gathered = asyncio.gather(*(final_output(stream) for stream in streams))
        # a client that leaves cancels it: nothing then reads how it ended
        gathered.add_done_callback(lambda done: done.cancelled() or done.exception())
        try:
            finals = await asyncio.wait_for(gathered, self.request_timeout)
        except asyncio.TimeoutError as exc:
            raise APIError(504, "request timed out", "timeout_error") from exc
        except (QueueFullError, EngineDeadError, RequestFailedError, ValueError) as exc:
            raise as_api_error(exc) from exc
        finally:
            for stream in streams:
                stream.close()
        if self.closing and any(_aborted(final) for final in finals):
            raise self._shutdown_error()
        return finals

    def _body(self, job: Job, finals: list[RequestOutput]) -> dict[str, Any]:
        choices = []
        generated = 0
        for prompt_index, output in enumerate(finals):
            # one object for every choice of the prompt: n choices cost one build
            scored = self.shapes.prompt_logprobs(output) if job.kind == "completion" else None
            for completion in output.outputs:
                choice_index = prompt_index * job.params.n + completion.index
                completion = shown(job, completion)
                generated += len(completion.token_ids)
                choices.append(
                    self.shapes.choice(job, prompt_index, choice_index, completion, output, scored)
                )
        body = {
            "id": job.request_id,
            "object": "text_completion" if job.kind == "completion" else "chat.completion",
            "created": job.created,
            "model": self.jobs.model_name,
            "choices": choices,
            "usage": self.shapes.usage(job, generated),
        }
        if job.kind == "chat":  # per choice on completions, once on chat, as vLLM's
            body["prompt_logprobs"] = self.shapes.prompt_logprobs(finals[0] if finals else None)
            if job.token_ids:
                body["prompt_token_ids"] = job.prompts[0][1]
        if finals and finals[-1].weight_version is not None:  # as SGLang's meta_info has it
            body["weight_version"] = finals[-1].weight_version
        return body

    async def stream(
        self, job: Job, include_usage: bool, continuous_usage: bool = False
    ) -> AsyncIterator[bytes]:
        """Streaming: SSE events, one finish_reason per choice, optional usage (with
        `continuous_usage`, also in every event, for its choice so far, as vLLM's), then
        DONE. An error before the first chunk is a single error event (the caller turns it
        into a plain error reply)."""
        streams = self._open(job, RequestOutputKind.DELTA)
        items = _merged(streams)
        sent: dict[int, int] = {}  # per choice whose first chunk was sent: its text's length
        made: dict[int, int] = {}  # per choice: its tokens so far

        def event(body: dict[str, Any], prompt_index: int, choice_index: int) -> bytes:
            if continuous_usage:
                body["usage"] = self.shapes.usage(job, made.get(choice_index, 0), prompt_index)
            return _sse(body)

        deadline = None if self.request_timeout is None else time.monotonic() + self.request_timeout
        try:
            while True:
                try:
                    if deadline is None:
                        index, item = await anext(items)
                    else:
                        remaining = max(0.0, deadline - time.monotonic())
                        index, item = await asyncio.wait_for(anext(items), remaining)
                except StopAsyncIteration:
                    break
                except asyncio.TimeoutError:
                    yield _sse(APIError(504, "request timed out", "timeout_error").body())
                    yield DONE  # as vLLM ends a stream after an error event
                    return
                if isinstance(item, BaseException):
                    yield _sse(_error_body(item))
                    yield DONE
                    return
                if self.closing and not sent and _aborted(item):
                    yield _sse(self._shutdown_error().body())  # nothing was sent yet
                    yield DONE
                    return
                if job.kind == "chat" and not sent:
                    for opening in self.shapes.openings(job):  # an event each, as vLLM's
                        yield event(opening, 0, opening["choices"][0]["index"])
                    sent = dict.fromkeys(range(job.params.n), 0)
                for completion in item.outputs:
                    choice_index = index * job.params.n + completion.index
                    completion = shown(job, completion)
                    made[choice_index] = made.get(choice_index, 0) + len(completion.token_ids)
                    first = choice_index not in sent
                    offset = sent.get(choice_index, 0)
                    chunk = self.shapes.delta(
                        job, index, choice_index, completion, item, first, offset
                    )
                    if chunk is not None:
                        sent[choice_index] = offset + len(chunk.get("text", ""))
                        yield event(self.shapes.chunk(job, [chunk]), index, choice_index)
            if include_usage:
                body = self.shapes.chunk(job, [])
                body["usage"] = self.shapes.usage(job, sum(made.values()))
                yield _sse(body)
            yield DONE
        finally:
            await items.aclose()
            for stream in streams:
                stream.close()


async def _merged(
    streams: list[RequestStream | BeamStream],
) -> AsyncIterator[tuple[int, RequestOutput | BaseException]]:
    """(prompt index, output or the error that ended it) from every stream as they come;
    one stream is read directly, without a task in between."""
    if len(streams) == 1:
        try:
            async for output in streams[0]:
                yield 0, output
        except Exception as exc:  # noqa: BLE001 - forwarded to the response
            yield 0, exc
        return
    merged: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, stream: RequestStream | BeamStream) -> None:
        try:
            async for output in stream:
                await merged.put((index, output))
        except BaseException as exc:  # noqa: BLE001 - forwarded to the response
            await merged.put((index, exc))
        finally:
            await merged.put((index, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    open_streams = len(tasks)
    try:
        while open_streams:
            index, item = await merged.get()
            if item is None:
                open_streams -= 1
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()


DONE = b"data: [DONE]\n\n"


def _sse(body: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(body) + b"\n\n"


def _aborted(output: RequestOutput) -> bool:
    return any(c.finish_reason == "abort" for c in output.outputs)


def _error_body(exc: BaseException) -> dict[str, Any]:
    return as_api_error(exc).body()


def _entries(job: Job, finals: list[RequestOutput]) -> int:
    """About how many tokens and logprob entries the body of `finals` holds: what building
    and rendering it costs."""
    width = 1 + (job.num_logprobs or 0)
    prompts = sum(len(output.prompt_token_ids or ()) for output in finals) if job.echo else 0
    generated = sum(len(c.token_ids) for output in finals for c in output.outputs)
    scored = sum(  # prompt_logprobs: per choice on completions
        len(output.outputs) * sum(len(entry or ()) for entry in output.prompt_logprobs)
        for output in finals
        if output.prompt_logprobs is not None
    )
    shown_ids = 0  # return_token_ids: the prompt's ids, counted per choice (chat's once)
    if job.token_ids:
        shown_ids = sum(len(o.outputs) * len(o.prompt_token_ids or ()) for o in finals)
    return (prompts + generated) * width + scored + shown_ids
