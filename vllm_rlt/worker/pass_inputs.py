"""Builds one pass's row inputs and attention metadata with tensor ops (no per-token loops)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_rlt.core.contract import PrefillChunk
from vllm_rlt.exit.policy import Upload
from vllm_rlt.ops.metadata import (
    PAD_KEY_POSITION,
    PAD_QUERY_POSITION,
    AttentionMetadata,
    PrefillTiles,
    Segments,
)
from vllm_rlt.worker.slot_state import SlotState
from vllm_rlt.worker.spec_lanes import SpecLanes


@dataclass
class KVGeometry:
    """Shape of the cache: planes of `slots_per_plane` entries, the last block a dummy.

    Each slot has `table_planes` block-table rows. One (LAST_EXITED, SHARED): a block holds
    a position range at every plane. SHARED_DECODE has one cache plane and a table row per
    loop instead: a prompt row at loop t reads and writes through row t, and the last row
    (the final plane) serves the prompt's last loop and every generated position, so the
    per-loop rows' blocks can be freed once the prompt is done."""

    planes: int
    block_size: int
    num_blocks: int
    write_deeper_planes: bool  # LAST_EXITED: a decode row also writes every deeper plane
    table_planes: int = 1

    def table_row(self, slot, plane):
        """Block-table row of `slot` at `plane` (ints or tensors)."""
        return slot * self.table_planes + plane

    def final_table_row(self, slot):
        return self.table_row(slot, self.table_planes - 1)

    @property
    def slots_per_plane(self) -> int:
        return (self.num_blocks + 1) * self.block_size

    @property
    def dummy_index(self) -> int:
        return self.num_blocks * self.block_size


@dataclass
class PassRows:
    """Per-row tensors of one pass: decode rows first, then prefill chunk rows."""

    tables: torch.Tensor  # [rows] block-table row each row reads and writes through
    positions: torch.Tensor  # [rows]
    loops: torch.Tensor  # [rows] 0-based loop each row runs
    write_hi: torch.Tensor  # [rows] one past the deepest plane a row writes


def decode_row_fields(
    decode: torch.Tensor, state: SlotState, geo: KVGeometry, lanes: SpecLanes | None
) -> PassRows:
    """Decode rows [decode] read position and loop from slot state, on the device.
    Speculation lanes use their request's block table; an idle lane reads the dummy, and
    idle and held lanes write no plane (`SpecLanes.idle_rows`). A row held back from
    exiting (worker/exit_sync.py) writes no plane either (write_hi 0)."""
    table_slots, positions, loops = decode, state.position[decode], state.loop[decode]
    quiet = None
    if lanes is not None:
        table_slots, positions, loops, quiet = lanes.idle_rows(decode, positions, loops)
    write_hi = torch.full_like(loops, geo.planes) if geo.write_deeper_planes else loops + 1
    if state.exit_wait is not None:
        write_hi = torch.where(state.exit_wait[decode] > 0, 0, write_hi)
    if quiet is not None:
        write_hi = torch.where(quiet, 0, write_hi)
    return PassRows(geo.final_table_row(table_slots), positions, loops, write_hi)


def row_seeds(state: SlotState, rows: PassRows, geo: KVGeometry, needed: bool):
    """[rows] each row's request seed (through its block-table row), for a model that draws
    its initial state from it; None when the model does not (`draws_initial_state`)."""
    return state.sampling.seed[rows.tables // geo.table_planes] if needed else None


def prompt_row_fields(chunks: tuple[PrefillChunk, ...], geo: KVGeometry) -> torch.Tensor:
    """[4, prompt rows] int64 on the host: table row, position, loop and write_hi of every
    prompt row, built per chunk (never per token)."""
    # A prompt row writes its own plane; a replayed row also the deeper ones, as the
    # decode row it was did.
    deep = geo.write_deeper_planes
    per_chunk = torch.tensor(
        [
            (
                len(c.token_ids),
                c.start,
                _chunk_table_row(c, geo),
                c.loop,
                geo.planes if deep and c.deep_writes else c.loop + 1,
            )
            for c in chunks
        ],
        dtype=torch.int64,
    )
    lengths = per_chunk[:, 0]
    spread = per_chunk.repeat_interleave(lengths, dim=0)  # [rows, 5]: each row its chunk's
    first_row = torch.cumsum(lengths, 0) - lengths  # of each chunk, among the prefill rows
    offset = torch.arange(spread.shape[0]) - first_row.repeat_interleave(lengths)
    return torch.stack([spread[:, 2], spread[:, 1] + offset, spread[:, 3], spread[:, 4]])


def last_loop_rows(chunks: tuple[PrefillChunk, ...], num_loops: int) -> torch.Tensor:
    """[prompt rows] int64 on the host: 1 for the rows of a chunk at its last loop (a
    prompt's positions exit there, so the layers after the loop run for them), else 0."""
    last = [int(c.loop == (c.depth or num_loops) - 1) for c in chunks]
    lengths = [len(c.token_ids) for c in chunks]
    return torch.tensor(last, dtype=torch.int64).repeat_interleave(torch.tensor(lengths))


def gather_rows(
    decode: torch.Tensor,
    chunks: tuple[PrefillChunk, ...],
    state: SlotState,
    geo: KVGeometry,
    lanes: SpecLanes | None = None,
    upload: Upload | None = None,
) -> PassRows:
    """The decode rows (see `decode_row_fields`), then the prefill rows, sent from the host
    in one `upload` (default: a plain copy). With no chunks every op stays on the device
    (the CUDA-graph case)."""
    rows = decode_row_fields(decode, state, geo, lanes)
    if not chunks:
        return rows
    flat = prompt_row_fields(chunks, geo).flatten()
    host = (flat.to(decode.device) if upload is None else upload(flat)).view(4, -1)  # [4, rows]
    return PassRows(
        tables=torch.cat([rows.tables, host[0]]),
        positions=torch.cat([rows.positions, host[1]]),
        loops=torch.cat([rows.loops, host[2]]),
        write_hi=torch.cat([rows.write_hi, host[3]]),
    )


def _chunk_table_row(chunk: PrefillChunk, geo: KVGeometry) -> int:
    """A prompt chunk uses its loop's table row; a replayed one, like the decode rows it
    was, the final one (with a single table row per slot both are the slot's)."""
    if chunk.deep_writes or geo.table_planes == 1:
        return geo.final_table_row(chunk.slot)
    return geo.table_row(chunk.slot, chunk.loop)


def build_metadata(
    rows: PassRows,
    chunks: tuple[PrefillChunk, ...],
    state: SlotState,
    geo: KVGeometry,
    max_context: int,
    with_segments: bool,
    tile_rows: int = 0,
    upload: Upload | None = None,
    lanes: SpecLanes | None = None,
) -> AttentionMetadata:
    """Flat cache indices: plane * slots_per_plane + block * block_size + offset. `upload`
    sends the prefill tiles (see `gather_rows`); `lanes`: the pass has speculation lanes,
    whose rows read what their request's other lanes write."""
    bs, spp = geo.block_size, geo.slots_per_plane
    shared = geo.planes == 1
    meta = AttentionMetadata(
        positions=rows.positions,
        row_tables=rows.tables,
        read_plane=torch.zeros_like(rows.loops) if shared else rows.loops,
        write_lo=torch.zeros_like(rows.loops) if shared else rows.loops,
        write_hi=rows.write_hi.clamp(max=1) if shared else rows.write_hi,
        row_entry=state.block_table[rows.tables, rows.positions // bs] * bs + rows.positions % bs,
        block_table=state.block_table,
        planes=geo.planes,
        slots_per_plane=spp,
        block_size=bs,
        dummy_entry=geo.dummy_index,
        rows_independent=not chunks and lanes is None,
    )
    if with_segments:
        meta.segments = _segments(rows, chunks, state, geo, max_context)
    elif chunks and tile_rows:
        meta.num_decode = rows.positions.shape[0] - sum(len(c.token_ids) for c in chunks)
        meta.prefill_tiles = _prefill_tiles(
            chunks, meta.num_decode, geo, tile_rows, upload, rows.positions.device
        )
    return meta


def _prefill_tiles(
    chunks: tuple[PrefillChunk, ...],
    first_row: int,
    geo: KVGeometry,
    tile_rows: int,
    upload: Upload | None,
    device: torch.device,
) -> PrefillTiles:
    table = prefill_tile_fields(chunks, first_row, geo, tile_rows).flatten()
    return PrefillTiles((table.to(device) if upload is None else upload(table)).view(5, -1))


def prefill_tile_fields(
    chunks: tuple[PrefillChunk, ...], first_row: int, geo: KVGeometry, tile_rows: int
) -> torch.Tensor:
    """[5, tiles] int64 on the host (see `PrefillTiles`): the chunks, whose rows start at
    `first_row` of the pass, cut into tiles of up to `tile_rows` rows."""
    fields: list[tuple[int, int, int, int, int]] = []
    row = first_row
    for chunk in chunks:
        n = len(chunk.token_ids)
        plane = 0 if geo.planes == 1 else chunk.loop
        table = _chunk_table_row(chunk, geo)
        for offset in range(0, n, tile_rows):
            length = min(tile_rows, n - offset)
            fields.append((row + offset, length, chunk.start + offset, table, plane))
        row += n
    return torch.tensor(fields, dtype=torch.int64).reshape(-1, 5).T


def _segments(
    rows: PassRows,
    chunks: tuple[PrefillChunk, ...],
    state: SlotState,
    geo: KVGeometry,
    max_context: int,
) -> Segments:
    """One segment per decode row and per prefill chunk (rows sharing table row and plane)."""
    device = rows.positions.device
    num_rows = rows.positions.shape[0]
    num_decode = num_rows - sum(len(c.token_ids) for c in chunks)
    max_q = max([1] + [len(c.token_ids) for c in chunks])
    seg_rows = torch.full((num_decode + len(chunks), max_q), num_rows, dtype=torch.int64)
    seg_rows[:num_decode, 0] = torch.arange(num_decode)
    start = num_decode
    for index, chunk in enumerate(chunks):
        n = len(chunk.token_ids)
        seg_rows[num_decode + index, :n] = torch.arange(start, start + n)
        start += n
    seg_rows = seg_rows.to(device)
    first_rows = seg_rows[:, 0]
    seg_tables, seg_loops = rows.tables[first_rows], rows.loops[first_rows]
    padded_pos = torch.cat([rows.positions, rows.positions.new_full((1,), PAD_QUERY_POSITION)])
    q_pos = padded_pos[seg_rows]  # [segs, max_q]

    bs = geo.block_size
    kv_pos = torch.arange(max(max_context, 1), device=device)  # [max_kv]
    blocks = state.block_table[seg_tables][:, kv_pos // bs]  # [segs, max_kv]
    read_plane = torch.zeros_like(seg_loops) if geo.planes == 1 else seg_loops
    kv_index = read_plane.unsqueeze(1) * geo.slots_per_plane + blocks * bs + kv_pos % bs
    last_q = q_pos.masked_fill(q_pos == PAD_QUERY_POSITION, -1).amax(dim=1)
    kv_positions = torch.where(
        kv_pos.unsqueeze(0) <= last_q.unsqueeze(1), kv_pos.unsqueeze(0), PAD_KEY_POSITION
    )
    return Segments(rows=seg_rows, q_pos=q_pos, kv_index=kv_index, kv_pos=kv_positions)
