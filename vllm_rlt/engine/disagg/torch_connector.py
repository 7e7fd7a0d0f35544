"""How a decode core reads a prefill core's K/V on one host: straight from the prefill
core's own KV pool, which that core makes visible to the host's other processes once (a
`TorchPoolHandle`). A handover then names only the blocks (`KVBlocks`); the prefill core keeps
them until the decode core has copied them into its own pool and says so. No copy is
staged outside the two pools, so a burst of long prompts cannot run a GPU out of memory
between them, and the bytes move once.

- CPU: the pool moves into one file in shared memory (/dev/shm where it has room), which
  the decode core maps (through the prefill core's descriptor where there is /proc).
- CUDA: each layer's K and V tensor is shared by its CUDA IPC handle with the GPU's id;
  the decode core, which sees that GPU too, maps them and copies device to device (two
  cores may share one GPU).

That is the torch connector (`--kv-connector torch`, and auto; engine/disagg/connector.py
says what a connector does). The nixl connector reads the same blocks through NIXL
instead of mapping the pool (engine/disagg/nixl_connector.py).
"""

from __future__ import annotations

import math
import os
import re
import tempfile
import uuid
from collections.abc import Callable
from typing import Any

import torch

from vllm_rlt.engine.disagg.connector import PoolHandle, pool_fields
from vllm_rlt.worker.kv_pool import KVPool, MappedPeer

PREFIX = "vllm-rlt-kv-"  # of every shared pool file's name
DTYPES = {  # a pool's element types, by name (float8: --kv-cache-dtype fp8)
    str(dtype): dtype
    for dtype in (
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.float64,
        torch.float8_e4m3fn,
        torch.float8_e5m2,
    )
}


class TorchPoolHandle(PoolHandle, tag="torch"):
    """How another process maps a prefill core's pool: kind "shm" (the file `name`, or the
    descriptor /proc/PID/fd/N, holds every layer's K, then every layer's V) or "cuda_ipc"
    (each tensor's IPC handle in `ipc`, K then V, on GPU `gpu`)."""

    kind: str
    name: str = ""
    ipc: list[list[Any]] = []
    gpu: str = ""  # cuda_ipc: the GPU's id in CUDA_VISIBLE_DEVICES terms (or its index)

    @property
    def named_file(self) -> str | None:
        """The pool's file where it has a name (CPU without /proc): someone must remove it
        should its core die."""
        return self.name if self.kind == "shm" and not self.name.startswith("/proc/") else None


class TorchConnector:
    """The torch connector (`KVConnector`): the decode core maps the prefill core's pool
    and copies from it on its own stream."""

    name = "torch"
    handle_type = TorchPoolHandle
    holds_local_pool = False

    @staticmethod
    def missing() -> str | None:
        return None

    def share(self, pool: KVPool) -> SharedPool:
        return SharedPool(pool)

    def open(self, handle: TorchPoolHandle, local: Callable[[], KVPool]) -> MappedPeer:
        return MappedPeer(_map(handle), local)

    def probe(self, peer: MappedPeer, device: torch.device) -> None:
        peer.pool.k[0][:1].to(device, copy=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def forget(self, peer: MappedPeer) -> None:
        """Nothing to let go of: a mapping goes with the last import that still holds it."""


class SharedPool:
    """A prefill core's pool, visible to the host's other processes until `close`."""

    @torch.inference_mode()
    def __init__(self, pool: KVPool) -> None:
        tensors = [*pool.k, *pool.v]
        first = tensors[0]
        self.path: str | None = None
        self.fd: int | None = None
        common = pool_fields(pool)
        if first.is_cuda:
            ipc = [list(t.untyped_storage()._share_cuda_()) for t in tensors]
            gpu = _visible_gpu_ids()[first.device.index or 0]
            self.handle = TorchPoolHandle(kind="cuda_ipc", ipc=ipc, gpu=gpu, **common)
            return
        per_tensor = first.numel()
        self.path, self.fd = _pool_file(per_tensor * len(tensors) * first.element_size())
        name = self.path or f"/proc/{os.getpid()}/fd/{self.fd}"
        flat = torch.from_file(name, shared=True, size=per_tensor * len(tensors), dtype=first.dtype)
        # The engine's tensors stay the same objects; only their memory moves to the file.
        for index, tensor in enumerate(tensors):
            start = index * per_tensor
            flat[start : start + per_tensor].copy_(tensor.reshape(-1))
            tensor.set_(flat.untyped_storage(), start, tensor.shape, tensor.stride())
        self.handle = TorchPoolHandle(kind="shm", name=name, **common)

    def close(self) -> None:
        """Drop this process's hold on the pool's file (processes that mapped it keep
        their mapping)."""
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        if self.path is not None:
            remove_files([self.path])
            self.path = None


def _pool_file(nbytes: int) -> tuple[str | None, int | None]:
    """A new file of `nbytes` for a pool, in /dev/shm if it has room, else the temp folder,
    its space taken now (a full disk fails here, not with a SIGBUS at a later write).
    Where /proc is, the file is unlinked at once and reached through this process's open
    descriptor, so its memory goes with the last process that maps it, however this one
    ends: (None, descriptor). Elsewhere: (its path, None), removed by `close`."""
    folder = tempfile.gettempdir()
    if os.path.isdir("/dev/shm"):
        stats = os.statvfs("/dev/shm")
        if stats.f_bavail * stats.f_frsize > 2 * nbytes:
            folder = "/dev/shm"
    path = os.path.join(folder, f"{PREFIX}{uuid.uuid4().hex}")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        if hasattr(os, "posix_fallocate"):
            os.posix_fallocate(fd, 0, nbytes)
        else:
            os.ftruncate(fd, nbytes)
    except BaseException:
        os.close(fd)
        remove_files([path])
        raise
    if os.path.isdir(f"/proc/{os.getpid()}/fd"):
        os.unlink(path)
        return None, fd
    os.close(fd)
    return path, None


def remove_files(paths: list[str]) -> None:
    for path in paths:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def _visible_gpu_ids() -> list[str]:
    """This process's GPUs by their system-wide ids, in its device order."""
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        return [gpu.strip() for gpu in listed.split(",") if gpu.strip()]
    return [str(index) for index in range(torch.cuda.device_count())]


def _map(handle: TorchPoolHandle) -> KVPool:
    dtype = DTYPES[handle.dtype]
    count = 2 * handle.num_layers
    if handle.kind == "cuda_ipc":
        torch.cuda._lazy_init()
        visible = _visible_gpu_ids()
        if handle.gpu not in visible:
            raise ValueError(f"the prefill core's K/V is on GPU {handle.gpu}, not visible here")
        tensors = []
        for ipc in handle.ipc:
            # The IPC handle numbers the device as the prefill core sees it; this is its
            # number here.
            storage = torch.UntypedStorage._new_shared_cuda(visible.index(handle.gpu), *ipc[1:])
            tensor = torch.empty(0, dtype=dtype, device=storage.device)
            tensors.append(tensor.set_(storage, 0, handle.shape))
    elif handle.kind == "shm":
        descriptor = re.fullmatch(r"/proc/\d+/fd/\d+", handle.name)
        if not (descriptor or os.path.basename(handle.name).startswith(PREFIX)):
            raise ValueError(
                f"a K/V pool handle names a file {PREFIX}... or /proc/PID/fd/N, got {handle.name!r}"
            )
        per_tensor = math.prod(handle.shape)
        flat = torch.from_file(handle.name, shared=True, size=per_tensor * count, dtype=dtype)
        tensors = [
            flat[index * per_tensor : (index + 1) * per_tensor].view(handle.shape)
            for index in range(count)
        ]
    else:
        raise ValueError(f"unknown K/V pool handle kind {handle.kind!r}")
    if len(tensors) != count:
        raise ValueError(f"a K/V pool handle carries {count} tensors, got {len(tensors)}")
    layers = handle.num_layers
    return KVPool(tensors[:layers], tensors[layers:], handle.planes, handle.block_size)
