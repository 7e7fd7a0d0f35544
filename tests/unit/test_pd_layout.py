"""Where `--disaggregate` cores run: a GPU each while there are enough, else the visible
GPUs in turn with each GPU's memory split between its cores; errors name the flag."""

from __future__ import annotations

import pytest

from vllm_rlt.config import CacheConfig
from vllm_rlt.engine.pd_client import pool_layout


def test_cores_take_gpus_in_turn_and_split_their_memory(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    envs, kwargs = pool_layout({"device": "cuda"}, 2)
    # each its own GPU first, and the other in view for CUDA IPC
    assert envs == [{"CUDA_VISIBLE_DEVICES": "3,5"}, {"CUDA_VISIBLE_DEVICES": "5,3"}]
    assert "cache_config" not in kwargs  # a GPU each: nothing to split
    cache = CacheConfig(gpu_memory_utilization=0.8, layout="shared_decode")
    envs, kwargs = pool_layout({"device": "cuda", "cache_config": cache}, 3)
    assert [env["CUDA_VISIBLE_DEVICES"] for env in envs] == ["3,5", "5,3", "3,5"]
    assert kwargs["cache_config"].gpu_memory_utilization == pytest.approx(0.4)
    assert kwargs["cache_config"].layout == cache.layout


def test_cpu_cores_need_no_gpu_and_bad_settings_name_the_flag(monkeypatch):
    assert pool_layout({"device": "cpu"}, 2)[0] == [{}, {}]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    with pytest.raises(ValueError, match="disaggregate on CUDA needs a visible GPU"):
        pool_layout({"device": "cuda"}, 2)
    with pytest.raises(ValueError, match="tensor_parallel_size must be 1"):
        pool_layout({"device": "cpu", "tensor_parallel_size": 2}, 2)
