"""User-facing results: RequestOutput and CompletionOutput."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm_rlt.logprobs import PromptLogprobs, SampleLogprobs


@dataclass
class CompletionOutput:
    """One sampled continuation; `exit_depths[i]` is the loops token i ran (the first is T).
    `stop_reason`: the stop id or stop string that ended it, None for EOS or another end."""

    index: int
    text: str
    token_ids: list[int]
    exit_depths: list[int]
    logprobs: SampleLogprobs | None
    finish_reason: str | None
    cumulative_logprob: float | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Timing and depth figures of one request."""

    arrival_time: float
    first_token_time: float | None = None
    finished_time: float | None = None
    time_to_first_token: float | None = None
    mean_loops_per_token: float | None = None

    @classmethod
    def of(
        cls,
        arrival: float,
        first_token: float | None,
        finished: float | None,
        decode_depths: list[int],
    ) -> RequestMetrics:
        """The figures from the times and the decode tokens' exit depths."""
        return cls(
            arrival_time=arrival,
            first_token_time=first_token,
            finished_time=finished,
            time_to_first_token=None if first_token is None else first_token - arrival,
            mean_loops_per_token=(
                sum(decode_depths) / len(decode_depths) if decode_depths else None
            ),
        )


@dataclass
class RequestOutput:
    """All completions of one prompt, in the order of their `index`. `error` says why the
    engine failed this request alone (its completions then end with "abort")."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(0.0))
    error: str | None = None
    # With SamplingParams.prompt_logprobs: None for the first prompt position, then per
    # position the prompt token's Logprob and the top alternatives' (vLLM's shape). Set once
    # the whole prompt has been computed.
    prompt_logprobs: PromptLogprobs | None = None
    num_cached_tokens: int | None = None  # prompt tokens served from the prefix cache
    weight_version: str | None = None  # the tag of the latest weight update that gave one
