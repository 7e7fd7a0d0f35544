"""Nanbeige on CUDA (Triton kernels without branch norms, GQA) equals the dense recompute."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from tests.unit.test_nanbeige import TINY, _dense_logits, _tiny_weights
from vllm_rlt import LLM, CacheConfig, SamplingParams

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_cuda_nanbeige_matches_dense(tmp_path, async_scheduling):
    from vllm_rlt import ExecutionConfig

    torch.backends.cuda.matmul.allow_tf32 = False
    weights = _tiny_weights()
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    save_file(weights, str(tmp_path / "model.safetensors"))
    llm = LLM(
        model=str(tmp_path),
        device="cuda",
        dtype="float32",
        cache_config=CacheConfig(num_blocks=64),
        execution_config=ExecutionConfig(async_scheduling=async_scheduling),
    )
    prompts = [[5, 77, 123, 9, 250, 31, 64] * 5, [8, 9]]
    params = SamplingParams(max_tokens=6, temperature=0.0, logprobs=3, ignore_eos=True)
    for prompt, output in zip(prompts, llm.generate(prompts, params, use_tqdm=False), strict=True):
        completion = output.outputs[0]
        dense = _dense_logits(weights, prompt + completion.token_ids[:-1]).log_softmax(-1)
        for step, token in enumerate(completion.token_ids):
            row = dense[len(prompt) - 1 + step]
            assert token == int(row.argmax())
            value = completion.logprobs[step][token].logprob
            assert value == pytest.approx(float(row[token]), abs=1e-4)
    assert llm.engine.all_blocks_free()
