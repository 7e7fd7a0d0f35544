"""Moving handed-over K/V (engine/kv_handover.py) from a prefill core's process to a decode
core's on one host, without the bytes passing through the frontend: the prefill core
stages each tensor and sends a small `KVHandle`; the decode core copies from it into its
own memory and says so; the prefill core then drops the staged copy.

- CPU: the staged bytes live in a file in shared memory (/dev/shm where there is one),
  named by the handle.
- CUDA: the staged tensor stays on the prefill core's device and the handle carries its
  CUDA IPC handle and the GPU's id; the decode core, which sees that GPU too, maps it and
  copies device to device (two cores may share one GPU).
"""

from __future__ import annotations

import math
import os
import tempfile
import uuid
from typing import Any

import msgspec
import torch

PREFIX = "vllm-rlt-kv-"  # of every staged file's name
DTYPES = {
    str(dtype): dtype for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64)
}


class KVHandle(msgspec.Struct, array_like=True):
    """Where a staged tensor is: `kind` "shm" (`name`: its file in shared memory) or
    "cuda_ipc" (the storage's IPC handle in `ipc`)."""

    kind: str
    shape: list[int]
    dtype: str
    name: str = ""
    ipc: list[Any] = []
    gpu: str = ""  # cuda_ipc: the GPU's id in CUDA_VISIBLE_DEVICES terms (or its index)


class KVStaging:
    """The prefill core's staged copies, by handover key, until `release`."""

    def __init__(self) -> None:
        self.held: dict[str, list[Any]] = {}

    def offer(self, key: str, kv: torch.Tensor) -> KVHandle:
        kv = kv.contiguous()
        shape, dtype = list(kv.shape), str(kv.dtype)
        if kv.is_cuda:
            self.held.setdefault(key, []).append(kv)
            ipc = list(kv.untyped_storage()._share_cuda_())
            gpu = _visible_gpu_ids()[kv.device.index or 0]
            return KVHandle("cuda_ipc", shape, dtype, ipc=ipc, gpu=gpu)
        folder = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
        path = os.path.join(folder, f"{PREFIX}{uuid.uuid4().hex}")
        self.held.setdefault(key, []).append(path)
        if kv.numel():
            staged = torch.from_file(path, shared=True, size=kv.numel(), dtype=kv.dtype)
            staged.copy_(kv.view(-1))
        else:
            open(path, "wb").close()
        return KVHandle("shm", shape, dtype, name=path)

    def release(self, key: str) -> None:
        """Drop what `key` staged (the decode core has its copy, or never will)."""
        for held in self.held.pop(key, []):
            if isinstance(held, str):
                os.unlink(held)

    def release_all(self) -> None:
        for key in list(self.held):
            self.release(key)


def _visible_gpu_ids() -> list[str]:
    """This process's GPUs by their system-wide ids, in its device order."""
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        return [gpu.strip() for gpu in listed.split(",") if gpu.strip()]
    return [str(index) for index in range(torch.cuda.device_count())]


def handle_bytes(handle: KVHandle) -> int:
    """Bytes of the tensor a handle stands for."""
    return math.prod(handle.shape) * torch.empty(0, dtype=DTYPES[handle.dtype]).element_size()


def receive(handle: KVHandle, device: torch.device) -> torch.Tensor:
    """This process's own copy of a staged tensor, on `device`."""
    dtype = DTYPES[handle.dtype]
    numel = math.prod(handle.shape)
    if handle.kind == "cuda_ipc":
        torch.cuda._lazy_init()
        visible = _visible_gpu_ids()
        if handle.gpu not in visible:
            raise ValueError(f"the staged K/V is on GPU {handle.gpu}, which is not visible here")
        # The IPC handle numbers the device as the prefill core sees it; this is its
        # number here. Opening waits (on the device) for the prefill core's copy.
        ipc = [visible.index(handle.gpu), *handle.ipc[1:]]
        storage = torch.UntypedStorage._new_shared_cuda(*ipc)
        staged = torch.empty(0, dtype=dtype, device=storage.device)
        staged.set_(storage, 0, handle.shape)
        return staged.to(device, copy=True)
    if handle.kind != "shm":
        raise ValueError(f"unknown K/V handle kind {handle.kind!r}")
    if not os.path.basename(handle.name).startswith(PREFIX):
        raise ValueError(f"a K/V handle names a staged file ({PREFIX}...), got {handle.name!r}")
    if not numel:
        return torch.empty(handle.shape, dtype=dtype, device=device)
    staged = torch.from_file(handle.name, shared=False, size=numel, dtype=dtype)
    return staged.view(handle.shape).to(device, copy=True)
