"""Beam search's settings, its sequences and their score, under vLLM's names
(`vllm.sampling_params.BeamSearchParams`, `vllm.beam_search`). The search itself runs in
engine/beam_search.py, one token a step through `LLM.generate`."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from vllm_rlt.config import require, require_int
from vllm_rlt.logprobs import Logprob

# Each step ranks 2 x beam_width candidates a beam (as transformers and vLLM do), read from
# the logprobs a token may return (sampling_params.MAX_LOGPROBS).
MAX_BEAM_WIDTH = 10
MAX_BEAM_TEMPERATURE = 100.0  # SamplingParams' temperature range


@dataclass
class BeamSearchParams:
    """`beam_width` beams kept a prompt, up to `max_tokens` new tokens each. A beam ends at
    an EOS token (unless `ignore_eos`) or when it fills the context. `temperature` 0 ranks
    the 2 x beam_width most likely next tokens of each beam; above 0, the token the step
    draws joins them when it is not among them. Beams are ranked by cumulative logprob over
    length ** `length_penalty`. `include_stop_str_in_output` keeps an ending EOS token's
    text in a served choice's text; `LLM.beam_search` returns the whole sequence's text
    either way, as vLLM's does."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        require_int(self.beam_width, "beam_width", 1, MAX_BEAM_WIDTH)
        require_int(self.max_tokens, "max_tokens", 1)
        for name in ("ignore_eos", "include_stop_str_in_output"):
            value = getattr(self, name)
            require(isinstance(value, bool), f"{name} must be True or False, got {value!r}", name)
        temperature = self.temperature
        require(
            _is_number(temperature) and 0.0 <= temperature <= MAX_BEAM_TEMPERATURE,
            f"temperature must be a number in [0.0, {MAX_BEAM_TEMPERATURE}], got {temperature!r}",
            "temperature",
        )
        penalty = self.length_penalty
        require(
            _is_number(penalty) and math.isfinite(penalty),
            f"length_penalty must be a finite number, got {penalty!r}",
            "length_penalty",
        )


@dataclass
class BeamSearchSequence:
    """One beam: `tokens` holds the prompt's ids, then the generated ones; `logprobs` holds,
    per generated token, the candidates its step ranked (token id -> Logprob). `text` is
    the whole sequence decoded (None without a tokenizer). `finish_reason` is "stop" for a
    beam that ended at an EOS token and "length" for one that reached max_tokens or the
    context; `stop_reason` stays None, as `generate` reports an EOS. `exit_depths[i]` is
    the loops the i-th new token ran."""

    tokens: list[int]
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    exit_depths: list[int] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_len: int = 0

    @property
    def token_ids(self) -> list[int]:
        """The generated ids alone."""
        return self.tokens[self.prompt_len :]


@dataclass
class BeamSearchOutput:
    """The best beams of one prompt, best first: at most beam_width of them."""

    sequences: list[BeamSearchSequence]


def beam_score(beam: BeamSearchSequence, eos_token_ids: frozenset[int], penalty: float) -> float:
    """Cumulative logprob over length ** penalty, the length without a final EOS token and
    with the prompt, as transformers and vLLM count it."""
    length = len(beam.tokens) - (beam.tokens[-1] in eos_token_ids)
    return beam.cum_logprob / (length**penalty)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
