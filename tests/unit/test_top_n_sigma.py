"""Top-n-sigma filtering against a plain torch statement of it, and the field reaching the
HTTP bodies and `vllm-rlt generate` by its name alone. `check_top_n_sigma` runs on any
device; tests/gpu runs it on CUDA."""

from __future__ import annotations

import torch

from vllm_rlt.entrypoints.cli import build_parser
from vllm_rlt.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from vllm_rlt.entrypoints.sampling_args import sampling_flags
from vllm_rlt.layers.sampler import SamplingTensors, filtered_probs, sample
from vllm_rlt.sampling_params import SamplingParams


def reference_probs(logits: torch.Tensor, temperature: float, n: float) -> torch.Tensor:
    """The distribution after temperature and top-n-sigma: tokens whose scaled logit is
    below the row's maximum minus n standard deviations are dropped."""
    scaled = logits / temperature
    top = scaled.max(dim=-1, keepdim=True).values
    floor = top - n * scaled.std(dim=-1, keepdim=True)
    return scaled.masked_fill(scaled < floor, float("-inf")).softmax(dim=-1)


def check_top_n_sigma(device: str) -> None:
    generator = torch.Generator().manual_seed(0)
    logits = (torch.randn(6, 300, generator=generator) * 3).to(device)
    rows = logits.shape[0]
    counters = torch.arange(rows, device=device)
    for temperature in (0.5, 1.0, 2.0):
        for n in (0.5, 1.0, 2.5):
            settings = SamplingTensors.filled(
                rows, device, temperature=temperature, top_n_sigma=n, seed=7
            )
            expected = reference_probs(logits, temperature, n)
            assert torch.allclose(filtered_probs(logits, settings), expected, atol=1e-6)
            assert int((expected > 0).sum()) < logits.numel()  # the filter dropped tokens
    off = SamplingTensors.filled(rows, device, temperature=1.0, seed=7)
    for n in (0.0, -1.0):  # off
        settings = SamplingTensors.filled(rows, device, temperature=1.0, top_n_sigma=n, seed=7)
        assert torch.equal(filtered_probs(logits, settings), filtered_probs(logits, off))
    for seed in range(4):
        plain = SamplingTensors.filled(rows, device, temperature=1.0, seed=seed)
        wide = SamplingTensors.filled(rows, device, temperature=1.0, top_n_sigma=1e4, seed=seed)
        tiny = SamplingTensors.filled(rows, device, temperature=1.0, top_n_sigma=1e-6, seed=seed)
        assert torch.equal(sample(logits, wide, counters), sample(logits, plain, counters))
        assert torch.equal(sample(logits, tiny, counters), logits.argmax(dim=-1))


def test_top_n_sigma_matches_the_reference_on_cpu():
    check_top_n_sigma("cpu")


def test_barred_tokens_do_not_count_toward_the_deviation():
    logits = torch.tensor([[4.0, 3.0, 0.0, float("-inf")]])
    settings = SamplingTensors.filled(1, temperature=1.0, top_n_sigma=1.0)
    kept = filtered_probs(logits, settings)[0] > 0
    expected = reference_probs(logits[:, :3], 1.0, 1.0)[0] > 0
    assert kept[:3].tolist() == expected.tolist() == [True, True, False]
    assert not kept[3]


def test_sampling_params_field_and_its_bounds():
    assert SamplingParams().top_n_sigma == 0.0
    assert SamplingParams(top_n_sigma=None).top_n_sigma == 0.0
    assert SamplingParams(top_n_sigma=1.5).top_n_sigma == 1.5


def test_http_field_and_cli_flag_exist():
    assert "top_n_sigma" in ChatCompletionRequest.model_fields
    request = CompletionRequest(model="m", prompt="x", top_n_sigma=1.5)
    assert request.sampling_params(4, None).top_n_sigma == 1.5
    ns = build_parser().parse_args(["generate", "--prompt", "x", "--top-n-sigma", "2"])
    assert sampling_flags(ns)["top_n_sigma"] == 2.0
