"""Two GPUs: tensor parallelism over NCCL (with CUDA graphs capturing the all-reduces) gives
the tokens and exit depths of one GPU, and two data-parallel engine cores behind one or two
API servers equal the offline engine request for request. Skipped with fewer than two GPUs."""

from __future__ import annotations

import pytest
import torch

from tests.e2e.test_tensor_parallel import PROMPTS, TRACES, _params
from vllm_rlt import LLM, CacheConfig, ExecutionConfig, ExitConfig

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs"
    ),
]


@pytest.mark.parametrize("exit_mode", ["ouro", "trace"])
@pytest.mark.parametrize("layout", ["last_exited", "shared"])
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_tensor_parallel_over_nccl_equals_one_gpu(exit_mode, layout, graphs):
    engine = {
        "device": "cuda",
        "dtype": "float32",
        "cache_config": CacheConfig(num_blocks=256, layout=layout),
        "exit_config": ExitConfig(
            mode=exit_mode, depths_by_request=TRACES if exit_mode == "trace" else {}
        ),
        "execution_config": ExecutionConfig(cuda_graphs=graphs),
    }
    one = LLM(model="toy", **engine).generate(PROMPTS, _params(), use_tqdm=False)
    two = LLM(model="toy", tensor_parallel_size=2, **engine).generate(
        PROMPTS, _params(), use_tqdm=False
    )
    for single, split in zip(one, two, strict=True):
        for a, b in zip(single.outputs, split.outputs, strict=True):
            assert a.token_ids == b.token_ids
            assert a.exit_depths == b.exit_depths


@pytest.mark.parametrize("api_servers", ["1", "2"])
def test_two_data_parallel_cores_on_two_gpus_equal_offline(api_servers):
    from tests.server.conftest import check_concurrent_streams, serve_process

    flags = ("--device", "cuda", "--dtype", "float32", "--data-parallel-size", "2")
    with serve_process(*flags, "--api-server-count", api_servers) as (_, url):
        check_concurrent_streams(url, 16, max_tokens=10)


@pytest.mark.skipif(torch.cuda.device_count() < 4, reason="needs 4 GPUs")
def test_two_data_parallel_cores_of_two_tensor_parallel_ranks_equal_offline():
    from tests.server.conftest import check_concurrent_streams, serve_process

    flags = ("--device", "cuda", "--dtype", "float32", "--data-parallel-size", "2")
    with serve_process(*flags, "--tensor-parallel-size", "2") as (_, url):
        check_concurrent_streams(url, 16, max_tokens=10)
