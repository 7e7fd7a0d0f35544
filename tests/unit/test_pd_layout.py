"""Where `--disaggregate` cores run: a GPU each while there are enough, else the visible
GPUs in turn with each GPU's memory split between its cores; errors name the flag."""

from __future__ import annotations

import pytest

from vllm_rlt.config import CacheConfig
from vllm_rlt.engine.process.pd_client import pool_layout
from vllm_rlt.engine_config import DeviceConfig, EngineConfig, ParallelConfig


def _config(device: str, tensor_parallel_size: int = 1, **fields) -> EngineConfig:
    return EngineConfig(
        device_config=DeviceConfig(device=device),
        parallel_config=ParallelConfig(tensor_parallel_size=tensor_parallel_size),
        **fields,
    )


def test_cores_take_gpus_in_turn_and_split_their_memory(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    config = _config("cuda")
    envs, shared = pool_layout(config, 2)
    # each its own GPU first, and the other in view for CUDA IPC
    assert envs == [{"CUDA_VISIBLE_DEVICES": "3,5"}, {"CUDA_VISIBLE_DEVICES": "5,3"}]
    assert shared == config  # a GPU each: nothing to split
    cache = CacheConfig(gpu_memory_utilization=0.8, layout="shared_decode")
    envs, shared = pool_layout(_config("cuda", cache_config=cache), 3)
    assert [env["CUDA_VISIBLE_DEVICES"] for env in envs] == ["3,5", "5,3", "3,5"]
    assert shared.cache_config.gpu_memory_utilization == pytest.approx(0.4)
    assert shared.cache_config.layout == cache.layout


def test_cpu_cores_need_no_gpu_and_bad_settings_name_the_flag(monkeypatch):
    assert pool_layout(_config("cpu"), 2)[0] == [{}, {}]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    with pytest.raises(ValueError, match="disaggregate on CUDA needs a visible GPU"):
        pool_layout(_config("cuda"), 2)
    assert pool_layout(_config("cpu", 2), 2)[0] == [{}, {}]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2")
    with pytest.raises(ValueError, match="2 engine cores x tensor_parallel_size 2 need 4 GPUs"):
        pool_layout(_config("cuda", 2), 2)


def test_tensor_parallel_cores_take_gpus_of_their_own(monkeypatch):
    """Rank r of a core runs on its cuda:r; the pool's other GPUs follow, for CUDA IPC."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    config = _config("cuda", 2)
    envs, shared = pool_layout(config, 2)
    assert envs == [{"CUDA_VISIBLE_DEVICES": "4,5,6,7"}, {"CUDA_VISIBLE_DEVICES": "6,7,4,5"}]
    assert shared == config
