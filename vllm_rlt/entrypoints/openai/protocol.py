"""OpenAI-compatible request models; unknown fields are rejected, never ignored."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from vllm_rlt.sampling_params import MAX_LOGPROBS, SamplingParams


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(StrictModel):
    include_usage: bool = False


class SamplingFields(StrictModel):
    """Fields shared by completions and chat completions."""

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=100.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=-1)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=0, le=2**63 - 1)
    n: int = Field(default=1, ge=1, le=128)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    presence_penalty: float = Field(default=0.0, ge=0.0, le=0.0)
    frequency_penalty: float = Field(default=0.0, ge=0.0, le=0.0)
    # Looped-model extensions.
    min_loops: int | None = Field(default=None, ge=1)
    max_loops: int | None = Field(default=None, ge=1)
    exit_threshold: float | None = Field(default=None, ge=0.0, le=1.0)
    return_exit_depths: bool = False

    def sampling_params(self, max_tokens: int, num_logprobs: int | None) -> SamplingParams:
        return SamplingParams(
            n=self.n,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            temperature=self.temperature,
            top_k=max(self.top_k, 0),
            top_p=self.top_p,
            min_p=self.min_p,
            seed=self.seed,
            stop=self.stop,
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            logprobs=num_logprobs,
            min_loops=self.min_loops,
            max_loops=self.max_loops,
            exit_threshold=self.exit_threshold,
        )


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(default=16, ge=1)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False

    @model_validator(mode="after")
    def _check(self) -> CompletionRequest:
        if isinstance(self.prompt, list) and len(self.prompt) == 0:
            raise ValueError("prompt must not be empty")
        if self.echo and self.logprobs is not None:
            raise ValueError("echo with logprobs is not supported (no prompt logprobs)")
        return self

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: text or token ids."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if all(isinstance(p, int) for p in prompt):
            return [list(prompt)]  # type: ignore[arg-type]
        return list(prompt)  # type: ignore[arg-type]


class ChatMessage(StrictModel):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]]
    name: str | None = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)

    @model_validator(mode="after")
    def _check(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=true")
        return self


class TokenizeRequest(StrictModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True

    @model_validator(mode="after")
    def _check(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        return self


class DetokenizeRequest(StrictModel):
    model: str | None = None
    tokens: list[int]
