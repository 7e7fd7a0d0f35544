"""vllm-rlt: an inference engine for looped language models with loop-level batching."""

from vllm_rlt.config import (
    CacheConfig,
    ExecutionConfig,
    ExitConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from vllm_rlt.engine.llm import LLM
from vllm_rlt.outputs import CompletionOutput, RequestOutput
from vllm_rlt.sampling_params import SamplingParams

__version__ = "0.1.0"

__all__ = [
    "LLM",
    "CacheConfig",
    "CompletionOutput",
    "ExecutionConfig",
    "ExitConfig",
    "RequestOutput",
    "SamplingParams",
    "SchedulerConfig",
    "SpeculativeConfig",
    "__version__",
]
