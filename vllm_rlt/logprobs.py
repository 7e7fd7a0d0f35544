"""vLLM's Logprob, and the shapes of a completion's and a prompt's logprobs."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Logprob:
    """A token's log probability, its rank among all tokens (1: the most likely) and its text
    (None without a tokenizer)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# Per generated token: its own Logprob and its top alternatives', by token id.
SampleLogprobs = list[dict[int, Logprob]]
# The same per prompt position; None for the first, which has no context.
PromptLogprobs = list[dict[int, Logprob] | None]
