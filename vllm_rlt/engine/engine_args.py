"""`EngineArgs`: the engine's settings as a user gives them, and the one place that makes
an `EngineConfig` of them. `LLM`'s keyword arguments and the command line's flags
(entrypoints/args.py) both arrive here, so equal settings give equal configs."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from vllm_rlt.config import (
    CacheConfig,
    ExecutionConfig,
    ExitConfig,
    SchedulerConfig,
    SpeculativeConfig,
    require,
)
from vllm_rlt.engine.vllm_args import apply_vllm_args
from vllm_rlt.engine_config import DeviceConfig, EngineConfig, ModelConfig, ParallelConfig
from vllm_rlt.models.hub import TOKENIZER_FILES, resolve_model


@dataclass(frozen=True)
class EngineArgs:
    """The settings before they are resolved: a hub ID with its `revision` and
    `download_dir` (fetched into the hub's cache by `create_engine_config`), vLLM's
    argument names in `vllm_args` (engine/vllm_args.py), and every other field as
    `EngineConfig` names it. A field left None takes its config's default."""

    model: str | None = None
    revision: str | None = None
    download_dir: str | None = None
    tokenizer: str | None = None
    skip_tokenizer_init: bool | None = None
    dtype: Any = None
    quantization: str | None = None
    max_model_len: int | None = None
    generation_config: str | None = None
    generation_config_ignore_invalid: bool | None = None
    device: Any = None
    attention_backend: str | None = None
    tensor_parallel_size: int | None = None
    data_parallel_size: int | None = None
    disaggregate: tuple[int, int] | None = None
    kv_connector: str | None = None
    usage_context: str | None = None
    cache_config: CacheConfig | None = None
    scheduler_config: SchedulerConfig | None = None
    exit_config: ExitConfig | None = None
    execution_config: ExecutionConfig | None = None
    speculative_config: SpeculativeConfig | None = None
    vllm_args: Mapping[str, Any] = field(default_factory=dict)

    def create_engine_config(self) -> EngineConfig:
        """The frozen config (vLLM's name): hub IDs fetched, vLLM's names applied over the
        configs, each part checked (ParamError names a bad field; FileNotFoundError says
        why a hub ID cannot be had). A name in `vllm_args` that is one of these fields
        (vLLM's `max_model_len`, `dtype`, ...) counts as that field."""
        own = {f.name for f in dataclasses.fields(self)} - {"vllm_args"}
        routed = {name: value for name, value in self.vllm_args.items() if name in own}
        if routed:
            for name, value in routed.items():
                given = getattr(self, name)
                require(
                    given is None or given == value,
                    f"{name} is given twice, as {given!r} and in vllm_args as {value!r}",
                    name,
                )
            rest = {name: value for name, value in self.vllm_args.items() if name not in own}
            return dataclasses.replace(self, vllm_args=rest, **routed).create_engine_config()
        cache, scheduler, execution = apply_vllm_args(
            dict(self.vllm_args), self.cache_config, self.scheduler_config, self.execution_config
        )
        model = ModelConfig(
            **_given(
                model=resolve_model(self.model, self.revision, self.download_dir),
                tokenizer=resolve_model(
                    self.tokenizer, download_dir=self.download_dir, files=TOKENIZER_FILES
                ),
                skip_tokenizer_init=self.skip_tokenizer_init,
                dtype=self.dtype,
                quantization=self.quantization,
                max_model_len=self.max_model_len,
                generation_config=self.generation_config,
                generation_config_ignore_invalid=self.generation_config_ignore_invalid,
            )
        )
        device = DeviceConfig(
            **_given(device=self.device, attention_backend=self.attention_backend)
        )
        parallel = ParallelConfig(
            **_given(
                tensor_parallel_size=self.tensor_parallel_size,
                data_parallel_size=self.data_parallel_size,
                disaggregate=self.disaggregate,
                kv_connector=self.kv_connector,
            )
        )
        return EngineConfig(
            model_config=model,
            device_config=device,
            parallel_config=parallel,
            cache_config=cache,
            scheduler_config=scheduler,
            execution_config=execution,
            speculative_config=self.speculative_config,
            **_given(exit_config=self.exit_config, usage_context=self.usage_context),
        )


def _given(**values: Any) -> dict[str, Any]:
    """The values set (not None): the rest take their config's default."""
    return {name: value for name, value in values.items() if value is not None}
