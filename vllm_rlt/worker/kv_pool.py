"""An engine's KV pool as prefill/decode handover sees it (engine/disagg/handover.py): the
pool, one completion's blocks in it, another engine's pool as read here (`PeerKVPool`),
where an imported completion reads its K/V, and the copy of that K/V between two pools
mapped in one process."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import msgspec
import numpy as np
import torch

# A run of entries consecutive in both pools moves as one slice copy per tensor and plane
# when it holds at least this many bytes; shorter runs are gathered together. A copy costs
# a few microseconds to launch, and a gathered import moved 109-161 GB/s on an H200 (a
# gather and a scatter kernel per piece), so a slice copy wins from about 1 MB on.
SLICE_COPY_BYTES = 1 << 20
GATHER_PIECE = 4096  # cache entries gathered at a time, so the gathered temporary stays small


@dataclass
class KVPool:
    """An engine's KV cache: per layer K and V [planes * slots_per_plane, kv_heads, head_dim],
    a plane's entries in blocks of `block_size` positions."""

    k: list[torch.Tensor]
    v: list[torch.Tensor]
    planes: int
    block_size: int

    @property
    def geometry(self) -> tuple[int, int, int, int, str]:
        """(layers, planes, kv_heads, head_dim, dtype): what a copy between pools must match."""
        first = self.k[0]
        return (len(self.k), self.planes, *first.shape[1:], str(first.dtype))

    @property
    def slots_per_plane(self) -> int:
        return self.k[0].shape[0] // self.planes

    @property
    def entry_bytes(self) -> int:
        """Bytes of one cache entry (one position's K or V of one layer and plane)."""
        first = self.k[0]
        return first[0].numel() * first.element_size()


class KVBlocks(msgspec.Struct, array_like=True):
    """One completion's K/V in its prefill core's pool: positions [0, num_positions) in
    `blocks` (in order, at every plane of that pool); `nbytes` is what a copy moves."""

    blocks: list[int]
    num_positions: int
    nbytes: int


class PeerKVPool(Protocol):
    """Another engine's pool as this engine reads it, whichever connector opened it
    (engine/disagg/connector.py): its `geometry` as `KVPool.geometry` gives it. A peer
    `in_stream` queues its reads on this engine's stream, ordered before every later pass,
    so they need no `after` event and their blocks no check that they have landed; any
    other peer reads outside that stream."""

    geometry: tuple[int, int, int, int, str]
    block_size: int
    in_stream: bool

    def read_into(self, blocks: KVBlocks, targets: list[int], start: int) -> None:
        """Copy positions [start, blocks.num_positions) into `targets` of this engine's
        pool (both tables count from position 0): done on return, or (`in_stream`)
        ordered before every later pass."""
        ...

    def start_read(self, blocks: KVBlocks, targets: list[int], start: int, after: Any) -> Any:
        """As `read_into`, started once `after` (a CUDA event, or None) has fired; returns
        at once what says the read has ended (a `done()` that raises if it failed), or
        None if there is nothing to wait for."""
        ...


class MappedPeer:
    """A peer's pool mapped into this process (the torch connector's, or one at hand when
    one process holds both cores): read by copies on this engine's stream into `local()`,
    its own pool."""

    in_stream = True

    def __init__(self, pool: KVPool, local: Callable[[], KVPool]) -> None:
        self.pool = pool
        self.local = local
        self.geometry = pool.geometry
        self.block_size = pool.block_size

    def read_into(self, blocks: KVBlocks, targets: list[int], start: int) -> None:
        copy_kv(self.pool, blocks.blocks, self.local(), targets, start, blocks.num_positions)

    def start_read(self, blocks: KVBlocks, targets: list[int], start: int, after: Any) -> None:
        """Queued in stream order, behind whatever `after` marks: nothing to wait for."""
        self.read_into(blocks, targets, start)


@dataclass(frozen=True)
class KVSource:
    """Where an imported completion's K/V is read from at its admission: its prefill core's
    pool as opened here. `landed` (if set) says whether the blocks a peer out of stream
    reads early for the same request have ended (engine/disagg/prefetch.py): admission waits
    for them rather than read them again."""

    pool: PeerKVPool
    blocks: KVBlocks
    landed: Callable[[], bool] | None = None

    def awaits_reads(self) -> bool:
        """Whether the blocks read early for its request are still on their way
        (`ImportedKV`, core/contract.py)."""
        return self.landed is not None and not self.landed()


def block_runs(
    sources: Sequence[int],
    targets: Sequence[int],
    start: int,
    end: int,
    block_size: int,
    target_block_size: int | None = None,
) -> np.ndarray:
    """[source row, target row, rows] within a plane for positions [start, end) of a
    completion held in blocks `sources` of one pool and `targets` of another (both tables
    count from position 0; the target's blocks hold `target_block_size` positions, the
    source's by default): piece by piece between either side's block boundaries, runs
    consecutive on both sides joined."""
    target_size = target_block_size or block_size
    runs: list[list[int]] = []
    position = start
    while position < end:
        source_index, source_offset = divmod(position, block_size)
        target_index, target_offset = divmod(position, target_size)
        length = (
            min(end, (source_index + 1) * block_size, (target_index + 1) * target_size) - position
        )
        source = sources[source_index] * block_size + source_offset
        target = targets[target_index] * target_size + target_offset
        previous = runs[-1] if runs else None
        if previous and previous[0] + previous[2] == source and previous[1] + previous[2] == target:
            previous[2] += length
        else:
            runs.append([source, target, length])
        position += length
    return np.array(runs, dtype=np.int64).reshape(-1, 3)


def copy_kv(
    source: KVPool,
    source_blocks: Sequence[int],
    target: KVPool,
    target_blocks: Sequence[int],
    start: int,
    end: int,
) -> None:
    """Copy positions [start, end) of one completion, every layer, K and V and plane, from
    `source` to `target` in stream order: runs of at least SLICE_COPY_BYTES as slice
    copies, the others gathered together."""
    runs = block_runs(
        source_blocks, target_blocks, start, end, source.block_size, target.block_size
    )
    long = runs[:, 2] * target.entry_bytes >= SLICE_COPY_BYTES
    pairs = [
        (_as_bytes(ours), _as_bytes(theirs))
        for ours, theirs in zip([*target.k, *target.v], [*source.k, *source.v], strict=True)
    ]
    theirs_per_plane, ours_per_plane = source.slots_per_plane, target.slots_per_plane
    for plane in range(target.planes):
        for first, into, rows in runs[long].tolist():
            first += plane * theirs_per_plane
            into += plane * ours_per_plane
            for ours, theirs in pairs:
                ours[into : into + rows].copy_(theirs[first : first + rows], non_blocking=True)
    short = runs[~long]
    if not len(short):
        return
    theirs_rows = _plane_rows(short[:, 0], short[:, 2], source.planes, theirs_per_plane)
    ours_rows = _plane_rows(short[:, 1], short[:, 2], target.planes, ours_per_plane)
    theirs_index = torch.from_numpy(theirs_rows).to(source.k[0].device)
    ours_index = torch.from_numpy(ours_rows).to(target.k[0].device)
    for lo in range(0, len(ours_rows), GATHER_PIECE):
        theirs_piece = theirs_index[lo : lo + GATHER_PIECE]
        piece = ours_index[lo : lo + GATHER_PIECE]
        for ours, theirs in pairs:
            ours[piece] = theirs[theirs_piece].to(ours.device)


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A float8 cache as its bytes, for the indexed copies torch lacks in float8."""
    return tensor.view(torch.uint8) if tensor.element_size() == 1 else tensor


def _plane_rows(firsts: np.ndarray, counts: np.ndarray, planes: int, per_plane: int) -> np.ndarray:
    """The pool rows of runs (`counts` rows from `firsts` within a plane) at every plane,
    plane by plane."""
    within = np.concatenate(
        [np.arange(first, first + count) for first, count in zip(firsts, counts, strict=True)]
    )
    return (np.arange(planes, dtype=np.int64)[:, None] * per_plane + within[None]).ravel()
