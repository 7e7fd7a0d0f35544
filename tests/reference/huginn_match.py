"""How the Huginn tests compare an engine completion with the oracle's result."""

from __future__ import annotations

import pytest

from tests.reference.huginn_oracle import HuginnResult


def assert_matches_oracle(completion, want: HuginnResult, prompt_len: int, atol: float) -> None:
    """Same tokens, same exit depths (token i came from position prompt_len - 1 + i), and
    each returned logprob within `atol` of the oracle's."""
    assert completion.token_ids == want.token_ids
    assert completion.exit_depths == want.steps[prompt_len - 1 :]
    for logprobs, logits in zip(completion.logprobs, want.logits, strict=True):
        reference = logits.log_softmax(-1)
        for token, entry in logprobs.items():
            assert entry.logprob == pytest.approx(float(reference[token]), abs=atol)
