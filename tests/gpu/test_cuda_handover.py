"""Prefill/decode handover on one GPU: two engine cores (Triton kernels, CUDA graphs,
asynchronous scheduling) give what one core gives, in both per-plane layouts, with the K/V
moved through CUDA IPC from another process."""

from __future__ import annotations

import multiprocessing

import msgspec
import pytest
import torch

from tests.unit.test_kv_handover import _assert_same, _colocated, _disaggregated, _requests
from vllm_rlt import CacheConfig, ExecutionConfig, ExitConfig, SchedulerConfig
from vllm_rlt.engine.builder import build_engine_core
from vllm_rlt.engine.kv_transport import KVHandle, KVStaging, receive
from vllm_rlt.models.ouro import OuroConfig, OuroModel
from vllm_rlt.tokenizer import Tokenizer

pytestmark = pytest.mark.gpu


def _engine(model, layout):
    return build_engine_core(
        model,
        Tokenizer.byte_level(),
        CacheConfig(layout=layout, num_blocks=256, block_size=4),
        SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=128),
        ExitConfig(),
        ExecutionConfig(cuda_graphs=True, async_scheduling=True),
        "triton",
        None,
    )


@pytest.mark.parametrize("layout", ["last_exited", "shared_decode"])
def test_cuda_handover_equals_one_core(toy_config, toy_state, exact_float32, layout):
    model = OuroModel(OuroConfig.from_dict(toy_config), toy_state, torch.float32, "cuda")
    expected = _colocated(_engine(model, layout), _requests())
    prefill, decode = _engine(model, layout), _engine(model, layout)
    got, handed = _disaggregated(prefill, decode, _requests())
    _assert_same(got, expected)
    assert handed and prefill.all_blocks_free() and decode.all_blocks_free()


def _stage_in_child(kv: list, queue, done) -> None:
    staging = KVStaging()
    tensor = torch.tensor(kv, device="cuda", dtype=torch.bfloat16)
    queue.put(msgspec.msgpack.encode(staging.offer("r", tensor)))
    done.wait(120)  # the staged tensor lives until the receiver has its copy
    staging.release("r")


def test_cuda_ipc_moves_a_tensor_between_processes():
    kv = torch.randn(2, 2, 4, 7, 3, 8).tolist()
    context = multiprocessing.get_context("spawn")
    queue, done = context.Queue(), context.Event()
    child = context.Process(target=_stage_in_child, args=(kv, queue, done))
    child.start()
    handle = msgspec.msgpack.decode(queue.get(timeout=120), type=KVHandle)
    assert handle.kind == "cuda_ipc"
    got = receive(handle, torch.device("cuda"))
    done.set()
    child.join(timeout=120)
    assert child.exitcode == 0
    assert torch.equal(got, torch.tensor(kv, device="cuda", dtype=torch.bfloat16))
