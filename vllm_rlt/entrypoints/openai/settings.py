"""The server's own settings (engine settings travel as LLM keyword arguments): frozen, and
checked when made, each error naming the `vllm-rlt serve` flag and its range."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm_rlt.config import ParamError
from vllm_rlt.engine.dp_client import MAX_DATA_PARALLEL, RemoteCores
from vllm_rlt.entrypoints.openai.serving import DEFAULT_MAX_SEQUENCES_PER_REQUEST

MAX_API_SERVERS = 64


@dataclass(frozen=True)
class ServerSettings:
    served_model_name: str | None = None
    api_key: str | None = None
    max_queue: int | None = None
    request_timeout: float | None = None
    max_body_bytes: int = 1 << 20
    stall_timeout: float = 60.0
    max_sequences_per_request: int = DEFAULT_MAX_SEQUENCES_PER_REQUEST
    header_timeout: float = 30.0
    body_timeout: float = 60.0
    keep_alive_timeout: float = 5.0
    max_connections: int | None = 4096
    max_header_bytes: int = 16 * 1024
    exit_on_load_error: bool = True
    access_log: bool = False
    engine_in_process: bool = False  # the core on a thread of this process (tests)
    api_server_count: int = 1
    data_parallel_size: int = 1
    remote_cores: RemoteCores | None = None  # data-parallel ranks on other hosts
    llm_kwargs: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        at_least_one = {
            "max-queue": self.max_queue,
            "max-body-bytes": self.max_body_bytes,
            "max-sequences-per-request": self.max_sequences_per_request,
            "max-header-bytes": self.max_header_bytes,
            "limit-concurrency": self.max_connections,
        }
        for flag, value in at_least_one.items():
            if value is not None and value < 1:
                _fail(flag, f"must be >= 1, got {value}")
        seconds = {
            "header-timeout": self.header_timeout,
            "body-timeout": self.body_timeout,
            "timeout-keep-alive": self.keep_alive_timeout,
        }
        for flag, value in seconds.items():
            if not value >= 0:  # NaN too
                _fail(flag, f"must be >= 0 seconds, got {value}")
        if self.request_timeout is not None and not self.request_timeout > 0:  # NaN too
            _fail("request-timeout", f"must be > 0 seconds, got {self.request_timeout}")
        if not self.stall_timeout > 0:
            _fail("stall-timeout", f"must be > 0 seconds, got {self.stall_timeout}")
        if not 1 <= self.api_server_count <= MAX_API_SERVERS:
            _fail(
                "api-server-count",
                f"must be in [1, {MAX_API_SERVERS}], got {self.api_server_count}",
            )
        if not 1 <= self.data_parallel_size <= MAX_DATA_PARALLEL:
            _fail(
                "data-parallel-size",
                f"must be in [1, {MAX_DATA_PARALLEL}], got {self.data_parallel_size}",
            )


def _fail(flag: str, problem: str) -> None:
    raise ParamError(f"--{flag} {problem}", flag.replace("-", "_"))
