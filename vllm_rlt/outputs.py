"""User-facing results: RequestOutput and CompletionOutput."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    """One sampled continuation; `exit_depths[i]` is the loops token i ran (the first is T)."""

    index: int
    text: str
    token_ids: list[int]
    exit_depths: list[int]
    logprobs: list[dict[int, float]] | None
    finish_reason: str | None
    cumulative_logprob: float | None = None

    @property
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
    # position the prompt token's logprob and the top alternatives (vLLM's shape). Set once
    # the whole prompt has been computed.
    prompt_logprobs: list[dict[int, float] | None] | None = None


def prompt_logprob_entries(
    prompt_token_ids: list[int],
    values: dict[int, tuple[float, tuple[tuple[int, float], ...]]],
) -> list[dict[int, float] | None] | None:
    """vLLM's prompt_logprobs list from per-position values, or None until every position
    after the first has its value."""
    if len(values) < len(prompt_token_ids) - 1:
        return None
    entries: list[dict[int, float] | None] = [None]
    for position in range(1, len(prompt_token_ids)):
        chosen, top = values[position]
        entry = dict(top)
        entry[prompt_token_ids[position]] = chosen
        entries.append(entry)
    return entries
