"""engine/kv_transport.py on CPU: a staged tensor reaches another process through shared
memory bit for bit, and releasing it removes its file."""

from __future__ import annotations

import multiprocessing
import os

import pytest
import torch

from vllm_rlt.engine.kv_transport import KVHandle, KVStaging, receive


def _receive_in_child(handle_bytes: bytes, queue) -> None:
    import msgspec

    handle = msgspec.msgpack.decode(handle_bytes, type=KVHandle)
    got = receive(handle, torch.device("cpu"))
    queue.put((str(got.dtype), got.shape, got.float().flatten().tolist()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_staged_tensor_arrives_whole_in_another_process(dtype):
    import msgspec

    kv = torch.randn(2, 2, 4, 5, 3, 8).to(dtype)
    staging = KVStaging()
    handle = staging.offer("r", kv[:, :, 1:])  # not contiguous: staged contiguously
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    child = context.Process(target=_receive_in_child, args=(msgspec.msgpack.encode(handle), queue))
    child.start()
    got_dtype, got_shape, values = queue.get(timeout=60)
    child.join(timeout=60)
    assert child.exitcode == 0
    expected = kv[:, :, 1:]
    assert got_dtype == str(dtype) and got_shape == expected.shape
    assert values == expected.float().flatten().tolist()  # bit for bit
    staging.release("r")
    assert not os.path.exists(handle.name)


def test_release_all_and_an_unknown_kind():
    staging = KVStaging()
    handles = [staging.offer(key, torch.ones(3)) for key in ("a", "b")]
    assert torch.equal(receive(handles[0], torch.device("cpu")), torch.ones(3))
    staging.release_all()
    assert not staging.held
    with pytest.raises(ValueError, match="unknown K/V handle kind"):
        receive(KVHandle("pipe", [1], "torch.float32"), torch.device("cpu"))
