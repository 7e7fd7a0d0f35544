"""An RL trainer's endpoints (`--enable-weight-updates`): vLLM's /pause and /resume, and
SGLang's weight updates from the trainer's group or from disk with a version tag; the API
key guards them as it guards every route (engine/rl_calls.py does the work)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI
from pydantic import Field

from vllm_rlt.engine.weight_sync import DEFAULT_GROUP_NAME
from vllm_rlt.entrypoints.openai.api_errors import as_api_error
from vllm_rlt.entrypoints.openai.protocol import RequestBody

if TYPE_CHECKING:
    from vllm_rlt.engine.async_llm import AsyncLLM


class InitWeightsUpdateGroupRequest(RequestBody):
    master_address: str
    master_port: int = Field(strict=True, ge=1, le=65535)
    rank_offset: int = Field(strict=True)  # ranges checked with world_size (weight_sync.py)
    world_size: int = Field(strict=True)
    group_name: str = DEFAULT_GROUP_NAME
    backend: str | None = None  # None: NCCL on CUDA, gloo on the CPU


class UpdateWeightsFromDistributedRequest(RequestBody):
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    weight_version: str | None = None


class UpdateWeightsFromDiskRequest(RequestBody):
    model_path: str
    weight_version: str | None = None


def add_rl_routes(app: FastAPI, engine: Callable[[], AsyncLLM]) -> None:
    """`engine()`: the loaded engine (raising the server's 503 while there is none). Pause
    and resume need the flag too: a pause stops every client's generation (vLLM keeps them
    behind its development mode)."""

    async def run(call) -> None:
        try:
            await call
        except Exception as exc:  # noqa: BLE001 - answered as an error object
            raise as_api_error(exc) from exc

    @app.post("/pause")
    async def pause(mode: str = "abort") -> dict[str, Any]:
        """vLLM's modes: "abort" (default), "wait", "keep"; answers once in effect."""
        await run(engine().pause_generation(mode))
        return {"is_paused": True}

    @app.post("/resume")
    async def resume() -> dict[str, Any]:
        await run(engine().resume_generation())
        return {"is_paused": False}

    @app.get("/is_paused")
    async def is_paused() -> dict[str, Any]:
        return {"is_paused": bool(engine().is_paused())}

    @app.get("/get_weight_version")
    async def get_weight_version() -> dict[str, Any]:
        return {"weight_version": engine().weight_version}

    @app.post("/init_weights_update_group")
    async def init_weights_update_group(body: InitWeightsUpdateGroupRequest) -> dict[str, Any]:
        await run(engine().init_weights_update_group(**body.model_dump()))
        return {"success": True, "message": "joined the weight-update group"}

    @app.post("/update_weights_from_distributed")
    async def update_weights_from_distributed(
        body: UpdateWeightsFromDistributedRequest,
    ) -> dict[str, Any]:
        served = engine()
        await run(served.update_weights_from_distributed(**body.model_dump()))
        return {"success": True, "weight_version": served.weight_version}

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(body: UpdateWeightsFromDiskRequest) -> dict[str, Any]:
        served = engine()
        await run(served.update_weights_from_disk(**body.model_dump()))
        return {"success": True, "weight_version": served.weight_version}
