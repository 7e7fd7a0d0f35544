"""Per-pass attention metadata: where each row writes its K/V and which keys it reads."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

# A padding key sits beyond every real position so no real query reads it; padding queries sit
# just below it so they always see at least one key and stay finite.
PAD_KEY_POSITION = 2**30
PAD_QUERY_POSITION = 2**30 - 1


@dataclass
class Segments:
    """Rows grouped by shared context (one request, one plane), for gather-based attention."""

    rows: torch.Tensor  # [segs, max_q] row of each query; `num_rows` marks padding
    q_pos: torch.Tensor  # [segs, max_q] query positions; PAD_QUERY_POSITION for padding
    kv_index: torch.Tensor  # [segs, max_kv] flat cache index of each key
    kv_pos: torch.Tensor  # [segs, max_kv] key positions; PAD_KEY_POSITION for padding


@dataclass
class PrefillTiles:
    """Prefill rows cut into tiles of consecutive positions of one request and plane.

    One tensor, one field per row, so the kernel gets one pointer: separate field tensors cut
    from one buffer would start at addresses whose alignment depends on the tile count, and
    Triton compiles a kernel variant per alignment (a pass with an odd tile count would pay a
    compile inside some request's latency)."""

    # [5, tiles] int64, one row per field: the tile's first row in the pass, its number of
    # rows, the position of its first row, the block-table row and the plane it reads
    fields: torch.Tensor

    @property
    def num_tiles(self) -> int:
        return self.fields.shape[1]


@dataclass
class DeviceCounts:
    """A captured pass's row and tile counts live on the device ([decode rows, prefill
    tiles] in `counts`), so one graph serves every mix of a padded size: the attention
    kernels run a bounded grid of programs that each take every grid-th row or tile."""

    counts: torch.Tensor  # [2] int64
    row_programs: int
    tile_programs: int


@dataclass
class AttentionMetadata:
    """Per-row cache addressing for one pass.

    The KV cache of a layer is a flat array of `planes * slots_per_plane` entries, so one flat
    index names both the plane and the token slot. Row r attends over positions
    0..positions[r] of plane `read_plane[r]` through block-table row `row_tables[r]`, and writes
    its own K/V into planes write_lo[r] .. write_hi[r] - 1 at entry `row_entry[r]` of each
    plane. A slot has one table row, or under SHARED_DECODE one per loop (see
    `KVGeometry.table_planes`).
    """

    positions: torch.Tensor  # [rows] absolute token position
    row_tables: torch.Tensor  # [rows] block-table row the row reads and writes through
    read_plane: torch.Tensor  # [rows]
    write_lo: torch.Tensor  # [rows]
    write_hi: torch.Tensor  # [rows]
    row_entry: torch.Tensor  # [rows] block * block_size + offset within a plane
    block_table: torch.Tensor  # [table rows, max_blocks] (the slot state's table)
    planes: int
    slots_per_plane: int
    block_size: int
    dummy_entry: int
    segments: Segments | None = None  # only for backends that gather per segment
    num_decode: int = 0  # rows before the prefill rows
    prefill_tiles: PrefillTiles | None = None  # only for backends with a tiled prefill kernel
    device_counts: DeviceCounts | None = None  # set: the counts are read on the device
    # no row reads K/V that another row of the pass writes (decode rows without speculation
    # lanes): a backend may write and attend in one kernel
    rows_independent: bool = False

    @property
    def num_rows(self) -> int:
        return self.positions.shape[0]

    def single_plane(self, writes: torch.Tensor | None = None) -> AttentionMetadata:
        """The same rows addressing a cache of one plane (a layer that runs once per token,
        such as a prelude or coda layer): every row reads plane 0 through the same block
        tables, and writes it where `writes` ([rows] bool; None: every row). A row that does
        not write is one whose output the layer drops, so it attends to its first key only:
        a decode kernel then reads one block for it, not its whole context."""
        zeros = torch.zeros_like(self.read_plane)
        write_hi = torch.ones_like(zeros) if writes is None else writes.to(zeros.dtype)
        positions = self.positions if writes is None else torch.where(writes, self.positions, 0)
        segments = self.segments
        if segments is not None:  # flat indices: drop the plane part
            segments = dataclasses.replace(
                segments, kv_index=segments.kv_index % self.slots_per_plane
            )
        tiles = self.prefill_tiles
        if tiles is not None:  # the last field is the plane a tile reads
            tiles = PrefillTiles(torch.cat([tiles.fields[:4], torch.zeros_like(tiles.fields[4:])]))
        return dataclasses.replace(
            self,
            positions=positions,
            read_plane=zeros,
            write_lo=zeros,
            write_hi=write_hi,
            planes=1,
            segments=segments,
            prefill_tiles=tiles,
        )

    @property
    def writing(self) -> torch.Tensor:
        """[rows] bool: rows that write K/V in this pass (a row held back from exiting,
        worker/exit_sync.py, writes none)."""
        return self.write_hi > self.write_lo

    def write_index(self) -> torch.Tensor:
        """[planes, rows] flat index each row writes per plane (the dummy where it does not)."""
        planes = torch.arange(self.planes, device=self.positions.device).unsqueeze(1)
        writes = (planes >= self.write_lo.unsqueeze(0)) & (planes < self.write_hi.unsqueeze(0))
        entry = torch.where(writes, self.row_entry.unsqueeze(0), self.dummy_entry)
        return planes * self.slots_per_plane + entry
