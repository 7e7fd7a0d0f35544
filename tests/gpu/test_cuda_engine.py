"""The engine on CUDA (torch attention backend) against the CPU oracle and the CPU engine."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import drain
from tests.e2e.test_engine_vs_oracle import MAX_TOKENS, POLICIES, _oracle, _prompts, _traces
from vllm_rlt import CacheConfig, ExecutionConfig, ExitConfig, SamplingParams, SchedulerConfig
from vllm_rlt.engine.engine_core import EngineCore
from vllm_rlt.models.ouro import OuroConfig, OuroModel
from vllm_rlt.tokenizer import Tokenizer

pytestmark = pytest.mark.gpu


def _cuda_engine(toy_config, toy_state, dtype, layout, policy, mode):
    exit_mode, _ = POLICIES[policy]
    model = OuroModel(OuroConfig.from_dict(toy_config), toy_state, dtype, "cuda")
    return EngineCore(
        model,
        Tokenizer.byte_level(),
        CacheConfig(layout=layout, num_blocks=128, block_size=4),
        SchedulerConfig(mode=mode, prefill_chunk_size=4, max_num_seqs=4, max_num_batched_tokens=64),
        ExitConfig(mode=exit_mode, depths_by_request=_traces() if exit_mode == "trace" else {}),
        ExecutionConfig(),
        "torch",
    )


def _run(engine, policy):
    _, threshold = POLICIES[policy]
    arrivals = {
        step: [
            (
                f"r{i}",
                prompt,
                SamplingParams(max_tokens=MAX_TOKENS[i], temperature=0.0, exit_threshold=threshold),
            )
        ]
        for i, (step, prompt) in enumerate(zip((0, 1, 3, 17), _prompts(), strict=True))
    }
    outputs = drain(engine, arrivals)
    assert engine.all_blocks_free()
    return outputs


@pytest.fixture(autouse=True)
def _exact_float32():
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = previous


@pytest.mark.parametrize("mode", ["refill", "no_refill"])
@pytest.mark.parametrize("policy", list(POLICIES))
@pytest.mark.parametrize("layout", ["last_exited", "shared"])
def test_cuda_float32_matches_oracle(toy_config, toy_state, layout, policy, mode):
    expected = _oracle(toy_config, toy_state, layout, policy)
    outputs = _run(_cuda_engine(toy_config, toy_state, torch.float32, layout, policy, mode), policy)
    for i, reference in enumerate(expected):
        completion = outputs[f"r{i}"].outputs[0]
        assert completion.token_ids == reference.token_ids
        assert completion.exit_depths == reference.exit_depths


def test_cuda_bfloat16_runs_and_stays_close(toy_config, toy_state):
    """bf16 rounds differently, so its tokens are not compared with float32 here; every
    request must still finish with valid exit depths and free all blocks."""
    engine = _cuda_engine(
        toy_config, toy_state, torch.bfloat16, "last_exited", "ouro_q0.7", "refill"
    )
    outputs = _run(engine, "ouro_q0.7")
    for i in range(len(_prompts())):
        completion = outputs[f"r{i}"].outputs[0]
        assert completion.exit_depths[0] == 4
        assert all(1 <= d <= 4 for d in completion.exit_depths)
        assert len(completion.token_ids) <= MAX_TOKENS[i]
