"""Prefill/decode handover on one GPU: two engine cores (Triton kernels, CUDA graphs,
asynchronous scheduling) give what one core gives, in both per-plane layouts, with the K/V
read through CUDA IPC from another process's pool, or through NIXL where it is installed."""

from __future__ import annotations

import multiprocessing

import msgspec
import pytest
import torch

from tests.unit.test_kv_handover import _assert_same, _colocated, _disaggregated, _requests
from vllm_rlt import CacheConfig, ExecutionConfig, ExitConfig, SchedulerConfig
from vllm_rlt.engine.builder import build_engine_core
from vllm_rlt.engine.kv_transport import KVPoolHandle, OpenedPools, SharedPool, share_pool
from vllm_rlt.models.ouro import OuroConfig, OuroModel
from vllm_rlt.tokenizer import Tokenizer
from vllm_rlt.worker.kv_pool import KVPool

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
    assert handed and prefill.all_blocks_free() and decode.all_blocks_free()  # released


@pytest.mark.parametrize("layout", ["last_exited", "shared_decode"])
def test_cuda_handover_through_nixl_equals_one_core(toy_config, toy_state, exact_float32, layout):
    pytest.importorskip("nixl._api")
    model = OuroModel(OuroConfig.from_dict(toy_config), toy_state, torch.float32, "cuda")
    expected = _colocated(_engine(model, layout), _requests())
    prefill, decode = _engine(model, layout), _engine(model, layout)
    shared = share_pool(prefill.runner.kv_pool, "nixl")
    try:
        peer = OpenedPools(lambda: decode.runner.kv_pool).open(shared.handle)
        assert shared.handle.memory == "VRAM"
        got, handed = _disaggregated(prefill, decode, _requests(), source=peer)
    finally:
        shared.close()
    _assert_same(got, expected)
    assert handed and prefill.all_blocks_free() and decode.all_blocks_free()


def _share_in_child(queue, done) -> None:
    generator = torch.Generator().manual_seed(0)
    k = [torch.randn(2 * 12, 3, 8, generator=generator).to("cuda", torch.bfloat16)]
    v = [torch.randn(2 * 12, 3, 8, generator=generator).to("cuda", torch.bfloat16)]
    shared = SharedPool(KVPool(k, v, planes=2, block_size=4))
    torch.cuda.synchronize()
    queue.put(msgspec.msgpack.encode(shared.handle))
    done.wait(120)  # the pool lives until the reader has its copy


def test_cuda_ipc_maps_another_process_pool():
    context = multiprocessing.get_context("spawn")
    queue, done = context.Queue(), context.Event()
    child = context.Process(target=_share_in_child, args=(queue, done))
    child.start()
    handle = msgspec.msgpack.decode(queue.get(timeout=120), type=KVPoolHandle)
    assert handle.kind == "cuda_ipc"
    pool = OpenedPools().open(handle)
    got = [t.clone() for t in [*pool.k, *pool.v]]
    torch.cuda.synchronize()
    done.set()
    child.join(timeout=120)
    assert child.exitcode == 0
    generator = torch.Generator().manual_seed(0)
    for tensor in got:
        want = torch.randn(2 * 12, 3, 8, generator=generator).to("cuda", torch.bfloat16)
        assert torch.equal(tensor, want)
