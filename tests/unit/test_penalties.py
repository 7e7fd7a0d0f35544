"""The batched logit adjustments against a plain per-token reference of vLLM's rules."""

from __future__ import annotations

import pytest
import torch

from vllm_rlt.core.contract import Penalties
from vllm_rlt.layers.penalties import apply_penalties
from vllm_rlt.layers.sampler import SamplingTensors, sample
from vllm_rlt.sampling_params import SamplingParams
from vllm_rlt.worker.slot_state import PenaltyState


def reference_adjust(
    logits: torch.Tensor,
    prompt: list[int],
    outputs: list[int],
    repetition: float,
    frequency: float,
    presence: float,
    bias: dict[int, float],
) -> torch.Tensor:
    """One row, token by token: bias, then repetition over prompt and outputs, then
    frequency (per output occurrence) and presence (once)."""
    out = logits.clone()
    for token, value in bias.items():
        out[token] += value
    for token in set(prompt) | set(outputs):
        out[token] = out[token] / repetition if out[token] > 0 else out[token] * repetition
    for token in set(outputs):
        out[token] -= frequency * outputs.count(token) + presence
    return out


@pytest.mark.parametrize("seed", range(6))
def test_batched_adjustments_equal_the_reference(seed):
    gen = torch.Generator().manual_seed(seed)
    rows, vocab = 5, 40
    logits = torch.randn(rows, vocab, generator=gen) * 3
    logits[0, 3] = float("-inf")  # a banned token stays banned
    cases = []
    for row in range(rows):
        prompt = torch.randint(0, vocab, (6,), generator=gen).tolist()
        outputs = torch.randint(0, vocab, (int(row * 2),), generator=gen).tolist()
        neutral = row == 4  # a row without adjustments in an adjusted pass
        cases.append(
            (
                prompt,
                outputs,
                1.0 if neutral else 0.5 + row * 0.4,
                0.0 if neutral else 0.3 * (row - 2),
                0.0 if neutral else -0.7 + 0.5 * row,
                {} if neutral else {row: 5.0, 7: -100.0},
            )
        )
    counts = torch.zeros(rows, vocab, dtype=torch.int32)
    prompt_mask = torch.zeros(rows, vocab, dtype=torch.bool)
    bias = torch.zeros(rows, vocab)
    for row, (prompt, outputs, repetition, _, _, row_bias) in enumerate(cases):
        for token in outputs:
            counts[row, token] += 1
        if repetition != 1.0:
            prompt_mask[row, prompt] = True
        for token, value in row_bias.items():
            bias[row, token] = value
    got = apply_penalties(
        logits,
        counts,
        prompt_mask,
        torch.tensor([c[2] for c in cases]),
        torch.tensor([c[3] for c in cases]),
        torch.tensor([c[4] for c in cases]),
        bias,
    )
    for row, case in enumerate(cases):
        want = reference_adjust(logits[row], *case)
        torch.testing.assert_close(got[row], want, atol=1e-5, rtol=0)
    assert torch.equal(got[4], logits[4])  # bit for bit


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"repetition_penalty": 0.0}, r"repetition_penalty must be in \[1e-30, 10\.0\], got 0\.0"),
        ({"repetition_penalty": float("nan")}, r"repetition_penalty must be in"),
        ({"frequency_penalty": 2.5}, r"frequency_penalty must be in \[-2.0, 2.0\], got 2.5"),
        ({"presence_penalty": -3}, r"presence_penalty must be in \[-2.0, 2.0\], got -3"),
        ({"logit_bias": {5: 101.0}}, r"logit_bias\[5\] must be in \[-100.0, 100.0\], got 101.0"),
        (
            {"logit_bias": {-1: 1.0}},
            r"logit_bias key -1 must be a token id in \[0, vocab_size - 1\]",
        ),
        ({"logit_bias": [1, 2]}, r"logit_bias must map token ids to numbers"),
        ({"skip_special_tokens": "no"}, r"skip_special_tokens must be true or false"),
    ],
)
def test_bad_adjustments_name_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message) as error:
        SamplingParams(**kwargs)
    assert error.value.param == next(iter(kwargs))


def test_a_row_left_without_tokens_samples_only_allowed_ones():
    """The request checks refuse what could empty a row; should one be empty all the same
    (every allowed token barred, or banned until min_tokens), it draws from its allowed
    tokens by the model's logits and bias, never NaN nor another token. Other rows keep
    their adjusted logits."""
    vocab = 8
    state = PenaltyState(3, vocab, torch.device("cpu"))
    neutral = dict(repetition=1.0, frequency=0.0, presence=0.0, prompt_token_ids=())
    state.set(0, Penalties(logit_bias=(), allowed_token_ids=(5,), bad_words=((5,),), **neutral))
    state.set(1, Penalties(logit_bias=((4, 9.0),), allowed_token_ids=(3, 4), **neutral))
    state.set(2, Penalties(logit_bias=(), allowed_token_ids=(2, 3), bad_words=((3,),), **neutral))
    model_logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(0))
    banned = model_logits.clone()
    banned[1, [3, 4]] = float("-inf")  # banned until min_tokens
    slots = torch.arange(3)
    adjusted = state.adjust(banned, slots, model_logits)
    assert torch.isfinite(adjusted[0]).tolist() == [token == 5 for token in range(vocab)]
    assert adjusted[1, 4] == model_logits[1, 4] + 9.0 and adjusted[1, 3] == model_logits[1, 3]
    assert torch.isneginf(adjusted[2, 3]) and adjusted[2, 2] == model_logits[2, 2]
    for temperature in (0.0, 1.0):
        settings = SamplingTensors.filled(3, temperature=temperature, seed=torch.arange(3))
        ids = sample(adjusted, settings, torch.zeros(3, dtype=torch.int64))
        assert ids.tolist() == [5, 4, 2]
