"""The nixl connector (`serve --disaggregate P:D --kv-connector nixl`): a decode core reads a
prefill core's K/V through NIXL (its UCX backend: CUDA IPC or NVLink between GPUs of one
host, RDMA between hosts, shared memory between processes on the CPU) instead of mapping
that core's pool into its own address space (engine/disagg/torch_connector.py).

The prefill core registers its pool with a NIXL agent once and puts the agent's metadata
and each tensor's address in its `NixlPoolHandle`. A decode core registers its own pool with
its own agent once, adds the prefill core's agent when it first sees that handle, and at an
import's admission reads the completion's blocks straight into its fresh blocks with one
READ: one descriptor per tensor (each layer's K and V), plane and run of blocks that are
consecutive on both sides. NIXL moves the bytes outside this process's CUDA stream, so the
read starts only once the pass in flight is done (its rows of a request that has just ended
may still write into blocks handed to the import) and the admission waits for the read to
finish before any pass can read those blocks. Prompt blocks lent early, and an import's
whole prompt blocks read ahead of its admission (engine/disagg/prefetch.py), are read without
waiting: `NixlPeer.start_read`.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from vllm_rlt.engine.disagg.connector import PoolHandle, pool_fields
from vllm_rlt.worker.kv_pool import KVBlocks, KVPool, block_runs

INSTALL_HINT = 'pip install nixl (or "vllm-rlt[nixl]")'
# A read's deadline: this long, plus its bytes at this rate (far below any transport's).
READ_DEADLINE_S = 30.0
READ_DEADLINE_BYTES_PER_S = 1e8


def _agent(role: str) -> Any:
    from nixl._api import nixl_agent, nixl_agent_config

    name = f"vllm-rlt-{role}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    agent = nixl_agent(name, nixl_agent_config(backends=["UCX"]))
    if "UCX" not in agent.backends:
        raise RuntimeError("the nixl package has no UCX backend here (its UCX plugin is missing)")
    return agent


def _memory_kind(tensor: torch.Tensor) -> str:
    return "VRAM" if tensor.is_cuda else "DRAM"


def _region(tensor: torch.Tensor) -> list[int]:
    """[address, bytes, device] of a contiguous tensor, as NIXL names memory."""
    if not tensor.is_contiguous():
        raise ValueError("the nixl connector needs contiguous K/V tensors")
    device = tensor.device.index if tensor.is_cuda else 0
    return [tensor.data_ptr(), tensor.numel() * tensor.element_size(), device or 0]


class NixlPoolHandle(PoolHandle, tag="nixl"):
    """How a decode core reads a prefill core's pool through NIXL: that core's agent
    metadata (`agent`), each tensor's [address, bytes, device] (`regions`, K then V) and
    their memory kind (`memory`, DRAM or VRAM)."""

    agent: bytes
    regions: list[list[int]]
    memory: str


class NixlConnector:
    """The nixl connector (`KVConnector`, engine/disagg/connector.py): its reader, this
    core's own pool registered with a NIXL agent, is made at the first handle it opens."""

    name = "nixl"
    handle_type = NixlPoolHandle

    def __init__(self) -> None:
        self.reader: NixlReader | None = None

    @staticmethod
    def missing() -> str | None:
        try:
            import nixl._api  # noqa: F401
        except ImportError as exc:
            return f"the nixl package is not installed ({exc}): {INSTALL_HINT}"
        return None

    def share(self, pool: KVPool) -> NixlSharedPool:
        return NixlSharedPool(pool)

    def open(self, handle: NixlPoolHandle, local: Callable[[], KVPool]) -> NixlPeer:
        self.reader = self.reader or NixlReader(local())
        return self.reader.open(handle)

    def probe(self, peer: NixlPeer, device: torch.device) -> None:
        peer.reader.probe(peer)

    def forget(self, peer: NixlPeer) -> None:
        """Remove the peer now: a read queued from it then fails its request alone."""
        peer.forgotten = True
        peer.reader.agent.remove_remote_agent(peer.agent_name)

    @property
    def holds_local_pool(self) -> bool:
        return self.reader is not None


class NixlSharedPool:
    """A prefill core's pool registered with its NIXL agent until `close`; `handle` is
    what decode cores need to read it."""

    def __init__(self, pool: KVPool) -> None:
        self.agent = _agent("prefill")
        tensors = [*pool.k, *pool.v]
        self.memory = _memory_kind(tensors[0])
        self.registered = self.agent.register_memory(tensors)
        self.handle = NixlPoolHandle(
            **pool_fields(pool),
            agent=self.agent.get_agent_metadata(),
            regions=[_region(tensor) for tensor in tensors],
            memory=self.memory,
        )

    def close(self) -> None:
        if self.registered is not None:
            self.agent.deregister_memory(self.registered)
            self.registered = None


class NixlPeer:
    """A prefill core's pool as a decode core reads it through NIXL (a `PeerKVPool`, the
    `source.pool` of an import's `KVSource`): its geometry, and `read_into` this core's
    pool, outside this core's stream."""

    in_stream = False

    def __init__(self, reader: NixlReader, handle: NixlPoolHandle) -> None:
        self.reader = reader
        self.metadata = handle.agent  # to reconnect after a failed read
        self.agent_name = reader.agent.add_remote_agent(handle.agent)
        self.regions = np.array(handle.regions, dtype=np.int64)
        self.memory = handle.memory
        self.planes = handle.planes
        self.block_size = handle.block_size
        self.geometry = _geometry(handle)
        self.per_plane = handle.shape[0] // handle.planes  # entries
        self.forgotten = False  # its prefill core is gone: never connect to it again

    def read_into(self, blocks: KVBlocks, targets: list[int], start: int) -> None:
        """Copy positions [start, blocks.num_positions) from `blocks` here into `targets`
        of the decode core's pool (both tables count from position 0); returns once they
        are there."""
        self.reader.read(self, blocks, targets, start)

    def start_read(
        self, blocks: KVBlocks, targets: list[int], start: int, after: Any
    ) -> NixlRead | None:
        """As `read_into`, but returns at once: the read starts once `after` (a CUDA event
        recorded behind the pass in flight, None: at once) has fired, and `NixlRead.done`
        says when it has ended (None: nothing to read)."""
        return self.reader.start(self, blocks, targets, start, after)


class NixlReader:
    """A decode core's NIXL agent with its own pool registered (once, at the first nixl
    handle it opens), reading from the prefill cores' pools it was shown."""

    def __init__(self, local: KVPool) -> None:
        self.agent = _agent("decode")
        self.local = local
        tensors = [*local.k, *local.v]
        self.memory = _memory_kind(tensors[0])
        self.regions = np.array([_region(tensor) for tensor in tensors], dtype=np.int64)
        self.per_plane = local.slots_per_plane
        self.registered = self.agent.register_memory(tensors)

    def open(self, handle: NixlPoolHandle) -> NixlPeer:
        """The pool `handle` names, checked against this core's: the nixl connector moves
        whole rows between pools of one geometry, memory kind and block size."""
        local = self.local
        if len(handle.shape) != 3 or handle.planes < 1 or handle.block_size < 1:
            raise ValueError(
                f"a nixl pool handle has a 3-d shape and planes and block_size of at least 1, "
                f"got shape {handle.shape}, planes {handle.planes}, block_size {handle.block_size}"
            )
        theirs = {
            "memory": handle.memory,
            "block_size": handle.block_size,
            "geometry": _geometry(handle),
            "regions": len(handle.regions),
        }
        ours = {
            "memory": self.memory,
            "block_size": local.block_size,
            "geometry": local.geometry,
            "regions": 2 * len(local.k),
        }
        for field, value in theirs.items():
            if value != ours[field]:
                raise ValueError(
                    f"the prefill core's pool has {field} {value}, this core's {ours[field]}: "
                    "the nixl connector reads between pools of one geometry"
                )
        return NixlPeer(self, handle)

    def probe(self, peer: NixlPeer) -> bool:
        """Read the peer's first block into this pool's last one, which only padding rows
        of captured passes write (the start-up check)."""
        last = self.per_plane // self.local.block_size - 1
        self.read(peer, KVBlocks([0], 1, 0), [last], 0)
        return True

    def read(self, peer: NixlPeer, blocks: KVBlocks, targets: list[int], start: int) -> None:
        first = self.local.k[0]
        if first.is_cuda:  # a pass in flight may still write into `targets`
            torch.cuda.synchronize(first.device)
        pending = self.start(peer, blocks, targets, start, None)
        while pending is not None and not pending.done():
            pass

    def start(
        self, peer: NixlPeer, blocks: KVBlocks, targets: list[int], start: int, after: Any
    ) -> NixlRead | None:
        runs = block_runs(blocks.blocks, targets, start, blocks.num_positions, peer.block_size)
        if not len(runs):
            return None
        planes, size = peer.planes, self.local.entry_bytes
        local = _descriptors(self.regions, runs[:, 1], runs[:, 2], planes, self.per_plane, size)
        remote = _descriptors(peer.regions, runs[:, 0], runs[:, 2], planes, peer.per_plane, size)
        return NixlRead(self.agent, peer, local, remote, after)


class NixlRead:
    """One READ of a decode core's agent from a prefill core's pool: it starts once `after`
    has fired (NIXL moves the bytes outside this process's CUDA stream, so a pass in flight
    that may still write into the targets must be done) and `done` polls it."""

    def __init__(
        self, agent: Any, peer: NixlPeer, local: np.ndarray, remote: np.ndarray, after: Any
    ) -> None:
        self.agent, self.peer, self.after = agent, peer, after
        self.local, self.remote = local, remote
        self.nbytes = int(local[:, 1].sum())
        self.transfer: Any = None
        self.deadline = 0.0
        self.ended = False

    def done(self) -> bool:
        """True once the read has ended (without blocking); raises if it failed or ran past
        its deadline (the peer is then connected afresh: the failure stays this read's)."""
        if self.ended:
            return True
        if self.after is not None and not self.after.query():
            return False
        try:
            if self.transfer is None:
                self._begin()
                state = self.agent.transfer(self.transfer)
            else:
                state = self.agent.check_xfer_state(self.transfer)
            if state == "PROC":
                if time.monotonic() > self.deadline:
                    raise TimeoutError(
                        f"the nixl read of {self.nbytes} K/V bytes from the prefill core did "
                        f"not finish in {self.deadline - self.started:.0f} s"
                    )
                return False
            if state != "DONE":
                raise RuntimeError(f"the nixl K/V read ended in state {state}")
        except Exception:
            self._end()
            peer = self.peer
            if not peer.forgotten:
                self.agent.remove_remote_agent(peer.agent_name)
                peer.agent_name = self.agent.add_remote_agent(peer.metadata)
            raise
        self._end()
        return True

    def _begin(self) -> None:
        agent, peer = self.agent, self.peer
        self.transfer = agent.initialize_xfer(
            "READ",
            agent.get_xfer_descs(self.local, peer.reader.memory),
            agent.get_xfer_descs(self.remote, peer.memory),
            peer.agent_name,
        )
        self.started = time.monotonic()
        self.deadline = self.started + READ_DEADLINE_S + self.nbytes / READ_DEADLINE_BYTES_PER_S

    def _end(self) -> None:
        self.ended = True
        if self.transfer is not None:
            try:
                self.agent.release_xfer_handle(self.transfer)
            except Exception:  # noqa: BLE001, S110 - the read's own outcome is what counts
                pass


def _geometry(handle: Any) -> tuple[int, int, int, int, str]:
    """A pool handle's (layers, planes, kv_heads, head_dim, dtype), as `KVPool.geometry`."""
    return (handle.num_layers, handle.planes, *handle.shape[1:], handle.dtype)


def _descriptors(
    regions: np.ndarray,
    first_rows: np.ndarray,
    counts: np.ndarray,
    planes: int,
    per_plane: int,
    row_bytes: int,
) -> np.ndarray:
    """[address, bytes, device] per tensor (`regions`), plane and run: `counts` rows from
    `first_rows` within each plane."""
    rows = np.arange(planes, dtype=np.int64)[:, None] * per_plane + first_rows[None, :]
    address = regions[:, 0, None, None] + rows[None] * row_bytes
    size = np.broadcast_to(counts * row_bytes, address.shape)
    device = np.broadcast_to(regions[:, 2, None, None], address.shape)
    return np.stack([address, size, device], axis=-1).reshape(-1, 3)
