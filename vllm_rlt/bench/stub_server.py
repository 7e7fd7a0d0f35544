"""A stand-in for the OpenAI-compatible server that does no inference and streams tokens as fast
as it can, so that `vllm-rlt bench serve` against it measures the load generator's own ceiling.

    python -m vllm_rlt.bench.stub_server --port 8100
    vllm-rlt bench serve --url http://127.0.0.1:8100 --num-requests 256 --output-len 32

GET /v1/models lists one model, "stub"; GET /health answers 200; POST /v1/completions always
streams: max_tokens events of one token each (exit depth 4), then a finish_reason "length"
event and [DONE]. It prints one line, with its address, once it is listening (--port 0 picks
a free port), and exits on SIGTERM or SIGINT.
"""

from __future__ import annotations

import asyncio
import signal
import sys
import time
from dataclasses import dataclass
from typing import Any

import orjson
from aiohttp import web

from vllm_rlt.bench.serve_client import run_async
from vllm_rlt.cli_parser import CLIParser

MODEL = "stub"
DONE = b"data: [DONE]\n\n"


@dataclass
class Streams:
    """Streams open now and the most open at once: what a client's concurrency limit allowed."""

    open: int = 0
    peak: int = 0


STREAMS = web.AppKey("streams", Streams)


def sse(body: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(body) + b"\n\n"


async def models(_: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model"}]})


async def health(_: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def completions(request: web.Request) -> web.StreamResponse:
    body = orjson.loads(await request.read())
    base = {
        "id": "cmpl-stub",
        "object": "text_completion",
        "created": int(time.time()),
        "model": body.get("model", MODEL),
    }
    choice = {"index": 0, "text": "x", "logprobs": None, "finish_reason": None}
    token = sse({**base, "choices": [{**choice, "exit_depths": [4]}]})
    finish = {**choice, "text": "", "finish_reason": "length", "exit_depths": []}
    reply = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await reply.prepare(request)
    streams = request.app[STREAMS]
    streams.open += 1
    streams.peak = max(streams.peak, streams.open)
    try:
        for _ in range(int(body.get("max_tokens", 16))):
            await reply.write(token)
            await asyncio.sleep(0)  # every open stream advances, as a real server's do
        await reply.write(sse({**base, "choices": [finish]}) + DONE)
    finally:
        streams.open -= 1
    await reply.write_eof()
    return reply


def build_app() -> web.Application:
    app = web.Application()
    app[STREAMS] = Streams()
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_post("/v1/completions", completions)
    return app


async def start(app: web.Application, host: str, port: int) -> tuple[web.AppRunner, int]:
    """Listen; the bound port. No access log (it would cost more than the stub's own work), and
    a backlog that holds a whole burst of connections (dropped ones retry after a second)."""
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port, backlog=4096).start()
    return runner, runner.addresses[0][1]


async def serve(host: str, port: int) -> None:
    runner, bound = await start(build_app(), host, port)
    print(f"stub server listening on http://{host}:{bound}", flush=True)
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stopping.set)
    try:
        await stopping.wait()
    finally:
        await runner.cleanup()


def main(argv: list[str] | None = None) -> int:
    parser = CLIParser(prog="python -m vllm_rlt.bench.stub_server", description=__doc__)
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=8100, help="port to listen on; 0: any free")
    args = parser.parse_args(argv)
    run_async(serve(args.host, args.port))
    return 0


if __name__ == "__main__":
    sys.exit(main())
