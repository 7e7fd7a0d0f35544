"""Exact preemption on CUDA in float32: a pool that forces requests out mid-output still
gives the oracle's tokens and exit depths, with CUDA graphs and asynchronous scheduling."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import drain
from tests.e2e.test_engine_vs_oracle import POLICIES
from tests.e2e.test_preemption import MAX_TOKENS, POOL, _oracle, _prompts, _traces
from vllm_rlt import CacheConfig, ExecutionConfig, ExitConfig, SamplingParams, SchedulerConfig
from vllm_rlt.engine.builder import build_engine_core
from vllm_rlt.engine_config import DeviceConfig, EngineConfig
from vllm_rlt.models.ouro import OuroConfig, OuroModel
from vllm_rlt.tokenizer import Tokenizer

pytestmark = [pytest.mark.gpu, pytest.mark.long, pytest.mark.usefixtures("exact_float32")]


@pytest.mark.parametrize(
    ("backend", "graphs", "async_scheduling", "mode"),
    [
        ("torch", False, False, "refill"),
        ("triton", True, False, "no_refill"),
        ("triton", True, True, "refill"),
    ],
    ids=["torch", "graphs-no_refill", "graphs-async"],
)
@pytest.mark.parametrize("policy", list(POLICIES))
@pytest.mark.parametrize("layout", ["last_exited", "shared", "shared_decode"])
def test_cuda_preemption_equals_oracle(
    toy_config, toy_state, layout, policy, backend, graphs, async_scheduling, mode
):
    exit_mode, threshold = POLICIES[policy]
    engine = build_engine_core(
        OuroModel(OuroConfig.from_dict(toy_config), toy_state, torch.float32, "cuda"),
        Tokenizer.byte_level(),
        EngineConfig(
            cache_config=CacheConfig(layout=layout, num_blocks=POOL, block_size=4),
            scheduler_config=SchedulerConfig(
                mode=mode, prefill_chunk_size=4, max_num_seqs=4, max_num_batched_tokens=64
            ),
            exit_config=ExitConfig(
                mode=exit_mode, depths_by_request=_traces() if exit_mode == "trace" else {}
            ),
            execution_config=ExecutionConfig(cuda_graphs=graphs, async_scheduling=async_scheduling),
            device_config=DeviceConfig(attention_backend=backend),
        ),
    )
    params = [
        SamplingParams(max_tokens=n, temperature=0.0, exit_threshold=threshold, ignore_eos=True)
        for n in MAX_TOKENS
    ]
    arrivals = {0: [(f"r{i}", p, params[i]) for i, p in enumerate(_prompts())]}
    outputs = drain(engine, arrivals)
    assert engine.scheduler.num_preemptions > 0 and engine.all_blocks_free()
    for i, reference in enumerate(_oracle(toy_config, toy_state, layout, policy)):
        completion = outputs[f"r{i}"].outputs[0]
        assert completion.token_ids == reference.token_ids, f"r{i} tokens"
        assert completion.exit_depths == reference.exit_depths, f"r{i} depths"
