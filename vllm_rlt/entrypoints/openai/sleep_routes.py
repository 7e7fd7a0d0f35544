"""The sleep-mode routes: an RL trainer takes the device memory while the server sleeps."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import FastAPI, Request

from vllm_rlt.engine.trainer_hooks import WAKE_TAGS
from vllm_rlt.entrypoints.openai.api_errors import APIError
from vllm_rlt.entrypoints.openai.server_state import ServerState


def add_sleep_routes(app: FastAPI, state: ServerState) -> None:
    """vLLM's sleep-mode endpoints (`--enable-sleep-mode`), answered by the engine core
    between passes; the API key guards them as it guards every route."""

    async def call(name: str) -> dict[str, Any]:
        state.ready()
        assert state.engine is not None
        try:
            answer = await asyncio.to_thread(state.engine.memory_call, name)
        except TimeoutError as exc:  # another call held the core (a long weight update)
            raise APIError(503, str(exc), "service_unavailable") from None
        if "error" in answer:
            raise APIError(409, str(answer["error"]), "conflict_error")
        return answer

    @app.post("/sleep")
    async def sleep(level: int = 1) -> dict[str, Any]:
        if level != 1:
            raise APIError(
                400,
                f"level must be 1 (level 2 drops the weights, which the server cannot load "
                f"again), got {level}",
                param="level",
            )
        return await call(f"sleep_{level}")

    @app.post("/wake_up")
    async def wake_up(request: Request) -> dict[str, Any]:
        tags = request.query_params.getlist("tags")  # vLLM's ?tags=weights&tags=kv_cache
        for tag in tags:
            if tag not in WAKE_TAGS:
                raise APIError(
                    400, f"tags must be among {list(WAKE_TAGS)}, got {tag!r}", param="tags"
                )
        return await call("wake_up:" + ",".join(tags) if tags else "wake_up")

    @app.get("/is_sleeping")
    async def is_sleeping() -> dict[str, Any]:
        return await call("is_sleeping")

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> dict[str, Any]:
        answer = await call("reset_prefix_cache")
        if not answer["reset"]:
            raise APIError(409, "requests hold KV blocks: reset when idle", "conflict_error")
        return answer
