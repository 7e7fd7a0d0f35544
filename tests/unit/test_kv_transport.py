"""engine/disagg/torch_connector.py on CPU: a pool shared by one process is read by another bit for
bit, later writes included (it is mapped, not copied); the sharing process's tensors keep
their values; closing removes the pool's file; bad handles are refused by name."""

from __future__ import annotations

import multiprocessing
import os

import msgspec
import pytest
import torch

from tests.conftest import pool_entries
from vllm_rlt.engine.disagg.links import OpenedPools
from vllm_rlt.engine.disagg.registry import KVPoolHandle
from vllm_rlt.engine.disagg.torch_connector import SharedPool
from vllm_rlt.worker.kv_pool import KVPool


def _pool(dtype) -> KVPool:
    generator = torch.Generator().manual_seed(0)
    k = [torch.randn(2 * 12, 3, 8, generator=generator).to(dtype) for _ in range(2)]
    v = [torch.randn(2 * 12, 3, 8, generator=generator).to(dtype) for _ in range(2)]
    return KVPool(k, v, planes=2, block_size=4)


def _share_in_child(dtype_name: str, queue, mapped, read) -> None:
    pool = _pool(getattr(torch, dtype_name))
    shared = SharedPool(pool)
    queue.put(msgspec.msgpack.encode(shared.handle))
    mapped.wait(60)
    pool.v[1][5].fill_(7)  # after the reader mapped it
    queue.put("written")
    read.wait(60)
    shared.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_a_shared_pool_is_read_in_another_process(dtype):
    context = multiprocessing.get_context("spawn")
    queue, mapped, read = context.Queue(), context.Event(), context.Event()
    name = str(dtype).removeprefix("torch.")
    child = context.Process(target=_share_in_child, args=(name, queue, mapped, read))
    child.start()
    handle = msgspec.msgpack.decode(queue.get(timeout=60), type=KVPoolHandle)
    assert handle.kind == "shm" and handle.planes == 2 and handle.block_size == 4
    pools = OpenedPools()
    peer = pools.open(handle)
    assert pools.open(handle) is peer and peer.in_stream  # mapped once, copied in stream
    opened = peer.pool
    expected = _pool(dtype)
    for got, want in zip([*opened.k, *opened.v], [*expected.k, *expected.v], strict=True):
        assert got.dtype == dtype
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))  # bit for bit
    entries = pool_entries(opened, [2, 0], 6)  # block 2 holds positions 0-3, block 0 holds 4-5
    assert entries.tolist() == [8, 9, 10, 11, 0, 1, 20, 21, 22, 23, 12, 13]
    mapped.set()
    assert queue.get(timeout=60) == "written"
    assert bool((opened.v[1][5].float() == 7).all())
    read.set()
    child.join(timeout=60)
    assert child.exitcode == 0
    assert not os.path.exists(handle.name)


def test_sharing_keeps_the_tensors_and_bad_handles_are_refused():
    pool = _pool(torch.float32)
    before = [t.clone() for t in [*pool.k, *pool.v]]
    k0 = pool.k[0]
    shared = SharedPool(pool)
    assert pool.k[0] is k0  # the engine's tensors stay; their memory moved
    assert all(torch.equal(a, b) for a, b in zip([*pool.k, *pool.v], before, strict=True))
    pool.k[0][0].fill_(3)
    pools = OpenedPools()
    opened = pools.open(shared.handle)
    assert bool((opened.pool.k[0][0] == 3).all())
    pools.forget(shared.handle.pool_id)  # its prefill core was lost: mapped anew if asked
    assert pools.open(shared.handle) is not opened
    shared.close()
    shared.close()
    handle = shared.handle
    with pytest.raises(ValueError, match="unknown K/V pool handle kind"):
        OpenedPools().open(msgspec.structs.replace(handle, kind="pipe"))
    with pytest.raises(ValueError, match="vllm-rlt-kv-"):
        OpenedPools().open(msgspec.structs.replace(handle, name="/etc/passwd"))
