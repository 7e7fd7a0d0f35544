"""An engine's KV pool as prefill/decode handover sees it (engine/kv_handover.py): the
pool, one completion's blocks in it, and where an imported completion reads its K/V."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import msgspec
import torch


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

    def entries(self, blocks: Sequence[int], num_positions: int, start: int = 0) -> torch.Tensor:
        """Cache entries of positions [start, num_positions) held in `blocks` (those of
        positions from 0), at every plane: plane by plane, on the pool's device."""
        positions = torch.arange(start, num_positions)
        table = torch.tensor(list(blocks), dtype=torch.int64)
        size = self.block_size
        rows = table[positions // size] * size + positions % size
        planes = torch.arange(self.planes).unsqueeze(1) * self.slots_per_plane
        return (planes + rows).flatten().to(self.k[0].device)


class KVBlocks(msgspec.Struct, array_like=True):
    """One completion's K/V in its prefill core's pool: positions [0, num_positions) in
    `blocks` (in order, at every plane of that pool); `nbytes` is what a copy moves."""

    blocks: list[int]
    num_positions: int
    nbytes: int


class RemoteKVPool(Protocol):
    """Another engine's pool read through a connector (engine/kv_nixl.py) instead of mapped
    into this process: its `geometry` as `KVPool.geometry` gives it."""

    geometry: tuple[int, int, int, int, str]

    def read_into(self, blocks: KVBlocks, targets: list[int], start: int) -> None:
        """Copy positions [start, blocks.num_positions) into `targets` of this engine's
        pool (both tables count from position 0), done on return."""
        ...


@dataclass(frozen=True)
class KVSource:
    """Where an imported completion's K/V is read from at its admission: a pool mapped
    here, or one a connector reads."""

    pool: KVPool | RemoteKVPool
    blocks: KVBlocks
