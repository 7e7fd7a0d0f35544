"""The server's own settings, with the engine's config they serve (`EngineConfig`): frozen,
and checked when made, each error naming the `vllm-rlt serve` flag and its range."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm_rlt.config import ParamError
from vllm_rlt.engine.disagg.registry import connector_class
from vllm_rlt.engine.process.dp_client import RemoteCores
from vllm_rlt.engine.process.remote_channel import channel_keys, check_address, check_ports
from vllm_rlt.engine_config import MAX_DATA_PARALLEL, EngineConfig
from vllm_rlt.entrypoints.openai.origins import origin_problem
from vllm_rlt.entrypoints.openai.request_jobs import (
    DEFAULT_MAX_LOGPROBS_PER_REQUEST,
    DEFAULT_MAX_SEQUENCES_PER_REQUEST,
)

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
    max_logprobs_per_request: int = DEFAULT_MAX_LOGPROBS_PER_REQUEST
    header_timeout: float = 30.0
    body_timeout: float = 60.0
    keep_alive_timeout: float = 5.0
    max_connections: int | None = 4096
    max_header_bytes: int = 16 * 1024
    exit_on_load_error: bool = True
    enable_sleep_mode: bool = False  # /sleep, /wake_up, /is_sleeping, /reset_prefix_cache
    enable_weight_updates: bool = False  # /pause, /resume, /update_weights_* (rl_routes.py)
    access_log: bool = False
    engine_in_process: bool = False  # the core on a thread of this process (tests)
    api_server_count: int = 1
    # browser origins that may call the server, and its CORS replies to them (origins.py)
    allowed_origins: tuple[str, ...] = ()
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False
    remote_cores: RemoteCores | None = None  # data-parallel ranks on other hosts
    # the engine served; its parallel config says which cores (engine/process/clients.py)
    engine_config: EngineConfig = field(default_factory=EngineConfig)

    def __post_init__(self) -> None:
        at_least_one = {
            "max-queue": self.max_queue,
            "max-body-bytes": self.max_body_bytes,
            "max-sequences-per-request": self.max_sequences_per_request,
            "max-logprobs-per-request": self.max_logprobs_per_request,
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
        if self.api_key is not None:
            check_api_key(self.api_key)
        for origin in self.allowed_origins:
            if problem := origin_problem(origin):
                _fail("allowed-origins", problem)
        for flag, names in (
            ("allowed-methods", self.allowed_methods),
            ("allowed-headers", self.allowed_headers),
        ):
            if not all(name.strip() for name in names):
                _fail(flag, "must not hold an empty string")
        if not 1 <= self.api_server_count <= MAX_API_SERVERS:
            _fail(
                "api-server-count",
                f"must be in [1, {MAX_API_SERVERS}], got {self.api_server_count}",
            )
        parallel = self.engine_config.parallel_config
        if parallel.disaggregate is not None:
            others = {
                "api-server-count": self.api_server_count != 1,
                "data-parallel-size-local": self.remote_cores is not None,
                # a decode core may be reading a prefill core's pool at any time
                "enable-sleep-mode": self.enable_sleep_mode,
            }
            for flag, used in others.items():
                if used:
                    _fail("disaggregate", f"runs alone: it cannot be combined with --{flag}")
        if (missing := connector_class(parallel.kv_connector).missing()) is not None:
            _fail("kv-connector", f"{parallel.kv_connector}: {missing}")
        if self.enable_weight_updates and (
            self.api_server_count != 1 or parallel.engine_cores != 1
        ):
            _fail(
                "enable-weight-updates",
                "needs one engine core and one API server (--data-parallel-size 1, "
                "--api-server-count 1, no --disaggregate)",
            )


def disaggregate_sizes(value: str) -> tuple[int, int]:
    """`--disaggregate P:D` -> (P, D), each in [1, MAX_DATA_PARALLEL]."""
    prefill, colon, decode = str(value).partition(":")
    if not colon or not prefill.strip().isdigit() or not decode.strip().isdigit():
        _fail("disaggregate", f"must be P:D (prefill and decode cores), got {value!r}")
    sizes = int(prefill), int(decode)
    if not all(1 <= size <= MAX_DATA_PARALLEL for size in sizes):
        _fail("disaggregate", f"needs P and D in [1, {MAX_DATA_PARALLEL}], got {value!r}")
    return sizes


def check_api_key(key: str) -> None:
    """A key a client can send as `Authorization: Bearer KEY`: not empty, no whitespace at
    its ends (HTTP strips it from a header value) and no control characters (a header
    cannot carry them). The error never shows the key."""
    if not key.strip():
        _fail("api-key", "must not be empty (leave it out to serve without a key)")
    if key != key.strip():
        _fail("api-key", "must not begin or end with whitespace: no client could send it")
    if any(ord(char) < 32 or ord(char) == 127 for char in key):
        _fail("api-key", "must not hold control characters: no HTTP header can carry them")


def _check_data_parallel_size(size: int) -> None:
    if not 1 <= size <= MAX_DATA_PARALLEL:
        _fail("data-parallel-size", f"must be in [1, {MAX_DATA_PARALLEL}], got {size}")


def _fail(flag: str, problem: str) -> None:
    raise ParamError(f"--{flag} {problem}", flag.replace("-", "_"))


@dataclass(frozen=True)
class DataParallelLayout:
    """Where the `--data-parallel-size` cores run: `local` of them beside this process
    (ranks from `start_rank` on a `--headless` host), the rest on other hosts, which reach
    the frontend at `address`, ports from `rpc_port` on, over a channel `api_key` keys.
    Checked when made, each error naming its flag."""

    size: int = 1
    local: int | None = None  # None: every core here
    start_rank: int = 0
    address: str = "127.0.0.1"
    rpc_port: int = 13345
    headless: bool = False
    api_server_count: int = 1
    api_key: str | None = None
    disaggregate: bool = False  # --disaggregate runs every core beside the server

    def __post_init__(self) -> None:
        size = self.size
        _check_data_parallel_size(size)
        if self.disaggregate and self.headless:
            _fail("disaggregate", "runs alone: it cannot be combined with --headless")
        if self.local is None:
            object.__setattr__(self, "local", size)
        local = self.local_cores
        if local < size and self.api_server_count > 1:
            raise ParamError(
                "data-parallel cores on other hosts run with one API server: "
                f"--api-server-count {self.api_server_count} needs "
                f"--data-parallel-size-local equal to --data-parallel-size ({size})",
                "api_server_count",
            )
        fewest = 1 if self.headless else 0
        if not fewest <= local <= size:
            _fail("data-parallel-size-local", f"must be in [{fewest}, {size}], got {local}")
        if self.headless and not 0 <= self.start_rank <= size - local:
            _fail(
                "data-parallel-start-rank",
                f"must be in [0, {size - local}] (the ranks of {local} cores among {size}), "
                f"got {self.start_rank}",
            )
        if self.remote:
            if not self.api_key:
                raise ParamError(
                    "cores on other hosts need --api-key (or VLLM_RLT_API_KEY): it keys the "
                    "encrypted channel between them and the frontend",
                    "api_key",
                )
            check_ports(self.rpc_port, size)
            check_address(self.address)

    @property
    def local_cores(self) -> int:
        assert self.local is not None  # filled in when made
        return self.local

    @property
    def remote(self) -> bool:
        """Some cores run on other hosts, or this process is one such host."""
        return self.headless or self.local_cores < self.size

    def remote_cores(self) -> RemoteCores | None:
        """The frontend's view of the cores on other hosts (None: every core is local)."""
        if self.local_cores == self.size:
            return None
        assert self.api_key is not None
        return RemoteCores(
            self.local_cores, self.address, self.rpc_port, channel_keys(self.api_key)
        )
