"""How a completion or chat completion job is answered over HTTP: built on the event loop or
a thread, answered whole or streamed, and given up (its requests aborted) once the client
leaves."""

from __future__ import annotations

import asyncio
import contextlib

import orjson
from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from vllm_rlt.entrypoints.openai.api_errors import FastJSONResponse
from vllm_rlt.entrypoints.openai.serving import OpenAIServing

INLINE_BODY_BYTES = 16 * 1024


async def build_job(make_job, body, request: Request):
    """Tokenize and validate: on the event loop for a small body (a thread hop costs more
    than the work), on a worker thread for a large one (so it cannot stall other clients)."""
    if len(await request.body()) <= INLINE_BODY_BYTES:
        return make_job(body)
    return await asyncio.to_thread(make_job, body)


async def respond(serving: OpenAIServing, job, stream: bool, options, request: Request):
    """Run a job while watching the client: one that leaves, even while its requests still
    wait for a slot, gets them aborted at once."""
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        if not stream:
            work = asyncio.ensure_future(serving.run(job))
            if not await _first_of(work, gone):
                return Response(status_code=499)
            return Response(work.result(), media_type="application/json")
        usage = bool(options and options.include_usage)
        events = serving.stream(job, usage, usage and options.continuous_usage_stats)
        first = asyncio.ensure_future(anext(events))
        if not await _first_of(first, gone):
            await events.aclose()
            return Response(status_code=499)
        head = first.result()
        if head.startswith(b'data: {"error"'):  # failed before streaming: a plain error reply
            await events.aclose()
            body = orjson.loads(head[len(b"data: ") :])
            return FastJSONResponse(body, status_code=body["error"]["code"])

        async def body_events():
            try:
                yield head
                async for event in events:
                    yield event
            finally:
                await events.aclose()

        return StreamingResponse(body_events(), media_type="text/event-stream")
    finally:
        gone.cancel()


async def _first_of(work: asyncio.Future, gone: asyncio.Future) -> bool:
    """Wait for `work` or the client's disconnect; False (and `work` cancelled) if the
    client left first."""
    await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    if work.done():
        return True
    work.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await work
    return False


async def _disconnected(request: Request) -> None:
    """Returns once the client has closed its connection."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
