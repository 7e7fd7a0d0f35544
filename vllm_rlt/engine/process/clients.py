"""`make_client`: the frontend's handle on its engine cores, of the class the config asks
for: one core (`EngineCoreClient`), several data-parallel ones (`DataParallelClient`), or
prefill and decode cores (`DisaggregatedClient`). Every class answers the same calls
(`CoreClient`), so the frontend never asks which one it holds."""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable
from typing import Protocol

from vllm_rlt.config import require
from vllm_rlt.engine.core_outputs import CoreStats
from vllm_rlt.engine.process.core_client import CoreAttachment, EngineCoreClient
from vllm_rlt.engine.process.dp_client import DataParallelClient, RemoteCores
from vllm_rlt.engine.process.messages import Command, EngineInfo, EngineOutputs
from vllm_rlt.engine.process.pd_client import DisaggregatedClient
from vllm_rlt.engine_config import EngineConfig


class CoreClient(Protocol):
    """What the frontend (`AsyncLLM`, the API-server launcher) uses of a client."""

    info: EngineInfo
    client: int  # this frontend's number at its cores

    @property
    def size(self) -> int: ...

    @property
    def processes(self) -> list[multiprocessing.process.BaseProcess]: ...

    def attachments_of(self, server: int) -> list[CoreAttachment]: ...

    def send(self, command: Command) -> object: ...

    def call(self, name: str, timeout: float = 30.0) -> CoreStats | dict[str, bool | str]: ...

    def start_reading(self, on_outputs: Callable[[EngineOutputs], None]) -> None: ...

    def lost_reason(self) -> str | None: ...

    def forget_core(self, rank: int) -> list[str]: ...

    def holds(self, request_id: str) -> bool:
        """Whether the client keeps records of the id that a core's later report clears
        (a new request of that id waits for it: engine/held_commands.py)."""
        ...

    def stalled(self, timeout: float, busy: bool) -> str | None: ...

    def shutdown(self, timeout: float = 30.0) -> None: ...


def make_client(
    config: EngineConfig,
    on_death: Callable[[str], None],
    on_core_lost: Callable[[int, str], None] | None = None,
    *,
    in_process: bool = False,
    remote_cores: RemoteCores | None = None,
    attach: list[CoreAttachment] | None = None,
    api_servers: int = 0,
) -> CoreClient:
    """Start `config`'s engine cores (or, with `attach`, join those another process
    started, one attachment per core) and return the client over them. `on_death(reason)`:
    every core is gone; `on_core_lost(rank, reason)`: one is, others serve on (None: any
    core's loss is a death). `remote_cores` run on other hosts; `api_servers` reserves that
    many more clients at each core for other processes to attach with."""
    parallel = config.parallel_config
    if attach is not None:
        require(len(attach) == parallel.data_parallel_size, "one attachment per data-parallel rank")
        if len(attach) == 1:
            return EngineCoreClient.attach(attach[0], on_death)
        return DataParallelClient.attach(attach, on_death, on_core_lost)
    if parallel.disaggregate is not None:
        return DisaggregatedClient(config, on_death, in_process, on_core_lost)
    if parallel.data_parallel_size > 1 or remote_cores is not None:
        return DataParallelClient(
            config, on_death, in_process, remote_cores, api_servers, on_core_lost
        )
    return EngineCoreClient(config, on_death, in_process, api_servers)
