"""The engine's whole configuration as one frozen, picklable `EngineConfig`: the model, the
device, how the engine is split over processes, and the cache, scheduler, exit, execution
and speculation settings of `vllm_rlt/config.py`. It is made once (`EngineArgs` in
engine/engine_args.py) and handed unchanged to every client, engine-core process and
tensor-parallel rank, so that a default lives only here and in config.py."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Any

from vllm_rlt.config import (
    KV_CONNECTORS,
    OFFLINE,
    USAGE_CONTEXTS,
    CacheConfig,
    ExecutionConfig,
    ExitConfig,
    SchedulerConfig,
    SpeculativeConfig,
    check_quantization,
    require,
    require_int,
)

MAX_DATA_PARALLEL = 64  # engine cores behind one frontend
MAX_TENSOR_PARALLEL = 64  # ranks one engine is split over
DEVICE_NAME = re.compile(r"cpu|cuda(:\d+)?")


@dataclass(frozen=True)
class ModelConfig:
    """What the engine loads.

    `model`: a checkpoint folder, None or "ouro-tasks" (the built-in model), or "toy"
    (random weights); a hub ID is resolved to its cache folder before it gets here.
    `tokenizer`: a folder with tokenizer.json (default: the model's); `skip_tokenizer_init`
    loads none (token-id prompts, outputs without text). `dtype`: "auto" (bf16 on CUDA,
    float32 elsewhere), a dtype name or a torch dtype. `quantization`: "fp8" (the layer
    projections in float8, quantized at load) or None. `max_model_len` caps prompt + output
    below the model's context length. `generation_config`: where unset sampling fields
    come from ("auto": the model's generation_config.json; "vllm": the engine's defaults;
    or a folder); `generation_config_ignore_invalid` leaves unset, with a warning, a field
    there that no request could send, instead of refusing to start.
    """

    model: str | None = None
    tokenizer: str | None = None
    skip_tokenizer_init: bool = False
    dtype: Any = "auto"  # a name, or a torch dtype
    quantization: str | None = None
    max_model_len: int | None = None
    generation_config: str = "auto"
    generation_config_ignore_invalid: bool = False

    def __post_init__(self) -> None:
        for name in ("model", "tokenizer"):  # a path object is kept as its text
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, os.fspath(value))
        check_quantization(self.quantization)
        require(  # its range, up to the model's context, is checked once the model is read
            self.max_model_len is None
            or (isinstance(self.max_model_len, int) and not isinstance(self.max_model_len, bool)),
            "max_model_len must be an integer in [1, the model's context], "
            f"got {self.max_model_len!r}",
            "max_model_len",
        )
        require(
            isinstance(self.generation_config, str) and bool(self.generation_config),
            f"generation_config must be 'auto', 'vllm' or a folder, got {self.generation_config!r}",
            "generation_config",
        )


@dataclass(frozen=True)
class DeviceConfig:
    """Where the engine runs: `device` "cpu" or "cuda[:N]" (a torch device is kept as its
    name), and the ops backend of its passes: `attention_backend` "auto" (the first
    available: triton on CUDA), "triton" or "torch" (the names are checked against the
    registry when the engine is built)."""

    device: str = "cpu"
    attention_backend: str = "auto"

    def __post_init__(self) -> None:
        object.__setattr__(self, "device", str(self.device))
        require(
            DEVICE_NAME.fullmatch(self.device) is not None,
            f"device must be 'cpu' or 'cuda[:N]', got {self.device!r}",
            "device",
        )
        require(
            isinstance(self.attention_backend, str) and bool(self.attention_backend),
            f"attention_backend must be a backend name, got {self.attention_backend!r}",
            "attention_backend",
        )


@dataclass(frozen=True)
class ParallelConfig:
    """How the engine is split over processes. `tensor_parallel_size` N splits every
    layer's heads and MLP features over N ranks; `data_parallel_size` runs that many whole
    engine cores behind one frontend; `disaggregate` (P, D) runs P prefill and D decode
    cores instead, whose K/V moves through `kv_connector` ("auto" is torch, or "nixl")."""

    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    disaggregate: tuple[int, int] | None = None
    kv_connector: str = "auto"

    def __post_init__(self) -> None:
        require_int(self.tensor_parallel_size, "tensor_parallel_size", 1, MAX_TENSOR_PARALLEL)
        require_int(self.data_parallel_size, "data_parallel_size", 1, MAX_DATA_PARALLEL)
        if self.disaggregate is not None:
            require(
                isinstance(self.disaggregate, (tuple, list)) and len(self.disaggregate) == 2,
                f"disaggregate must be (prefill cores, decode cores), got {self.disaggregate!r}",
                "disaggregate",
            )
            object.__setattr__(self, "disaggregate", tuple(self.disaggregate))
            for cores in self.disaggregate:
                require_int(cores, "disaggregate cores", 1, MAX_DATA_PARALLEL, "disaggregate")
            require(
                self.data_parallel_size == 1,
                "disaggregate runs alone: it cannot be combined with data_parallel_size "
                f"{self.data_parallel_size}",
                "disaggregate",
            )
        require(
            self.kv_connector in KV_CONNECTORS,
            f"kv_connector must be one of {', '.join(KV_CONNECTORS)}, got {self.kv_connector!r}",
            "kv_connector",
        )
        require(
            self.kv_connector == "auto" or self.disaggregate is not None,
            "kv_connector applies to --disaggregate only",
            "kv_connector",
        )

    @property
    def engine_cores(self) -> int:
        """Engine cores behind the frontend: prefill and decode ones, or data-parallel."""
        if self.disaggregate is not None:
            return sum(self.disaggregate)
        return self.data_parallel_size


@dataclass(frozen=True)
class EngineConfig:
    """Everything an engine is built from. `usage_context` ("offline": a batch handed to
    `LLM.generate`; "serve": requests arriving over time) picks the scheduler defaults the
    device sizes (engine/device_defaults.py); `speculative_config` None decodes without
    self-speculation."""

    model_config: ModelConfig = field(default_factory=ModelConfig)
    device_config: DeviceConfig = field(default_factory=DeviceConfig)
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    cache_config: CacheConfig = field(default_factory=CacheConfig)
    scheduler_config: SchedulerConfig = field(default_factory=SchedulerConfig)
    exit_config: ExitConfig = field(default_factory=ExitConfig)
    execution_config: ExecutionConfig = field(default_factory=ExecutionConfig)
    speculative_config: SpeculativeConfig | None = None
    usage_context: str = OFFLINE

    def __post_init__(self) -> None:
        kinds = {
            "model_config": ModelConfig,
            "device_config": DeviceConfig,
            "parallel_config": ParallelConfig,
            "cache_config": CacheConfig,
            "scheduler_config": SchedulerConfig,
            "exit_config": ExitConfig,
            "execution_config": ExecutionConfig,
        }
        for name, kind in kinds.items():
            value = getattr(self, name)
            require(
                isinstance(value, kind),
                f"{name} must be a {kind.__name__}, got {type(value).__name__}",
                name,
            )
        require(
            self.speculative_config is None
            or isinstance(self.speculative_config, SpeculativeConfig),
            "speculative_config must be a SpeculativeConfig or None, "
            f"got {type(self.speculative_config).__name__}",
            "speculative_config",
        )
        require(
            self.usage_context in USAGE_CONTEXTS,
            f"usage_context must be one of {', '.join(USAGE_CONTEXTS)}, got {self.usage_context!r}",
            "usage_context",
        )
