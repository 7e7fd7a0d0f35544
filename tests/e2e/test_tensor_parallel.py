"""Tensor parallelism over gloo on the CPU: the toy model split over two processes gives the
float32 tokens and exit depths of one process, and logprobs equal up to the order of the
all-reduce's sums, in every exit mode, KV layout and scheduling mode, and with fp8 weights."""

from __future__ import annotations

import gc

import pytest
import torch.distributed

from vllm_rlt import LLM, CacheConfig, ExitConfig, SamplingParams, SchedulerConfig
from vllm_rlt.parallel.tensor_parallel import TensorParallelLost

PROMPTS = ["hello world", "347+589=", "a longer prompt about loops and depth", "x"]
# depth of the prefill (all loops) then of each decode input, per request id (trace mode)
TRACES = {str(i): (4,) + tuple(1 + (i + j) % 4 for j in range(16)) for i in range(len(PROMPTS))}


def _params() -> list[SamplingParams]:
    return [
        SamplingParams(max_tokens=10, temperature=0.0, logprobs=2, exit_threshold=0.5),
        SamplingParams(max_tokens=10, temperature=0.0, logprobs=2, exit_threshold=1.0),
        SamplingParams(max_tokens=10, temperature=0.8, seed=7, logprobs=2, exit_threshold=0.7),
        SamplingParams(max_tokens=10, temperature=0.0, n=2, exit_threshold=0.3),
    ]


def _generate(tensor_parallel_size: int, **engine) -> list:
    llm = LLM(model="toy", tensor_parallel_size=tensor_parallel_size, **engine)
    return llm.generate(PROMPTS, _params(), use_tqdm=False)


@pytest.mark.parametrize(
    ("exit_mode", "layout", "scheduling", "quantization"),
    [  # every exit mode, both layouts, both scheduling modes, fp8 weights
        ("ouro", "last_exited", "refill", None),
        ("ouro", "shared", "no_refill", None),
        ("ouro_delayed", "shared", "refill", None),
        ("random_lookahead", "last_exited", "refill", None),
        ("trace", "shared", "refill", None),
        ("ouro", "last_exited", "refill", "fp8"),
    ],
)
def test_two_ranks_equal_one_process(exit_mode, layout, scheduling, quantization):
    """Under fp8 every rank quantizes the whole model before taking its share, so a rank's
    columns of o and down keep the scales of whole rows."""
    engine = {
        "quantization": quantization,
        "cache_config": CacheConfig(num_blocks=64, layout=layout),
        "scheduler_config": SchedulerConfig(mode=scheduling),
        "exit_config": ExitConfig(
            mode=exit_mode, depths_by_request=TRACES if exit_mode == "trace" else {}
        ),
    }
    one, two = _generate(1, **engine), _generate(2, **engine)
    for single, split in zip(one, two, strict=True):
        for a, b in zip(single.outputs, split.outputs, strict=True):
            assert a.token_ids == b.token_ids
            assert a.exit_depths == b.exit_depths
            assert (a.logprobs is None) == (b.logprobs is None)
            for x, y in zip(a.logprobs or [], b.logprobs or [], strict=True):
                assert x.keys() == y.keys()
                assert all(abs(x[token].logprob - y[token].logprob) < 1e-4 for token in x)


def test_unsupported_splits_are_clear_errors():
    with pytest.raises(ValueError, match=r"tensor_parallel_size 3 must divide the model's"):
        LLM(model="toy", tensor_parallel_size=3)
    with pytest.raises(ValueError, match=r"tensor_parallel_size must be in \[1, 64\], got 0"):
        LLM(model="toy", tensor_parallel_size=0)


def test_a_lost_rank_stops_the_engine_with_its_reason():
    """A rank that dies makes the next engine call raise TensorParallelLost (which passes
    the handlers that fail one request), naming the rank."""
    llm = LLM(model="toy", tensor_parallel_size=2)
    follower = llm.tensor_parallel.followers[0]
    follower.kill()
    follower.join(30)
    with pytest.raises(TensorParallelLost, match=r"tensor-parallel rank 1 exited with code -9"):
        llm.generate(PROMPTS[:1], use_tqdm=False)
    del llm
    gc.collect()  # its engine's finalizer leaves the group, so this process may join another
    assert not torch.distributed.is_initialized()
