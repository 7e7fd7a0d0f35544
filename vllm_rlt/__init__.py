"""vllm-rlt: an inference engine for looped language models with loop-level batching."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm_rlt.config import (
    CacheConfig,
    ExecutionConfig,
    ExitConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from vllm_rlt.inputs import PromptType, TextPrompt, TokensPrompt
from vllm_rlt.outputs import CompletionOutput, RequestOutput
from vllm_rlt.sampling_params import RequestOutputKind, SamplingParams

if TYPE_CHECKING:
    from vllm_rlt.engine.engine_args import EngineArgs
    from vllm_rlt.engine.llm import LLM

__version__ = "0.1.0"

__all__ = [
    "LLM",
    "CacheConfig",
    "CompletionOutput",
    "EngineArgs",
    "ExecutionConfig",
    "ExitConfig",
    "PromptType",
    "RequestOutput",
    "RequestOutputKind",
    "SamplingParams",
    "SchedulerConfig",
    "SpeculativeConfig",
    "TextPrompt",
    "TokensPrompt",
    "__version__",
]


def __getattr__(name: str) -> Any:
    """`LLM` and `EngineArgs` are imported on first use: they load torch, which the command
    line must not pay for to parse its flags or print help."""
    if name == "LLM":
        from vllm_rlt.engine.llm import LLM

        return LLM
    if name == "EngineArgs":
        from vllm_rlt.engine.engine_args import EngineArgs

        return EngineArgs
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
