"""Builds one pass's row inputs and attention metadata with tensor ops (no per-token loops)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_rlt.attention.metadata import (
    PAD_KEY_POSITION,
    PAD_QUERY_POSITION,
    AttentionMetadata,
    Segments,
)
from vllm_rlt.core.contract import SchedulerOutput
from vllm_rlt.worker.slot_state import SlotState


@dataclass
class KVGeometry:
    """Shape of the cache: planes of `slots_per_plane` entries, the last block a dummy."""

    planes: int
    block_size: int
    num_blocks: int
    write_deeper_planes: bool  # LAST_EXITED: a decode row also writes every deeper plane

    @property
    def slots_per_plane(self) -> int:
        return (self.num_blocks + 1) * self.block_size

    @property
    def dummy_index(self) -> int:
        return self.num_blocks * self.block_size


@dataclass
class PassRows:
    """Per-row tensors of one pass: decode rows first, then prefill chunk rows."""

    slots: torch.Tensor  # [rows] slot of each row
    positions: torch.Tensor  # [rows]
    loops: torch.Tensor  # [rows] 0-based loop each row runs
    write_hi: torch.Tensor  # [rows] one past the deepest plane a row writes
    seg_rows: torch.Tensor  # [segs, max_q]
    seg_q_pos: torch.Tensor  # [segs, max_q]
    seg_slots: torch.Tensor  # [segs]
    seg_loops: torch.Tensor  # [segs]


def gather_rows(out: SchedulerOutput, state: SlotState, geo: KVGeometry) -> PassRows:
    """Decode rows read position and loop from slot state; prefill rows come from the host."""
    device = state.loop.device
    decode = torch.tensor(out.decode_slots, dtype=torch.int64, device=device)  # [decode]
    num_decode = decode.shape[0]
    host_slots, host_pos, host_loops = [], [], []
    seg_rows_host: list[list[int]] = []
    row = num_decode
    for chunk in out.prefill_chunks:
        n = len(chunk.token_ids)
        host_slots.append(torch.full((n,), chunk.slot, dtype=torch.int64))
        host_pos.append(torch.arange(chunk.start, chunk.start + n))
        host_loops.append(torch.full((n,), chunk.loop, dtype=torch.int64))
        seg_rows_host.append(list(range(row, row + n)))
        row += n
    num_rows = row
    max_q = max([1] + [len(rows) for rows in seg_rows_host])
    chunk_rows = torch.full((len(seg_rows_host), max_q), num_rows, dtype=torch.int64)
    for index, rows in enumerate(seg_rows_host):
        chunk_rows[index, : len(rows)] = torch.tensor(rows)

    def cat(decode_part: torch.Tensor, host_parts: list[torch.Tensor]) -> torch.Tensor:
        host = torch.cat(host_parts).to(device) if host_parts else decode_part[:0]
        return torch.cat([decode_part, host])

    d_loops = state.loop[decode]
    slots = cat(decode, host_slots)
    positions = cat(state.position[decode], host_pos)
    loops = cat(d_loops, host_loops)
    decode_hi = torch.full_like(d_loops, geo.planes) if geo.write_deeper_planes else d_loops + 1
    write_hi = torch.cat([decode_hi, loops[num_decode:] + 1])

    decode_seg_rows = torch.full((num_decode, max_q), num_rows, dtype=torch.int64, device=device)
    decode_seg_rows[:, 0] = torch.arange(num_decode, device=device)
    seg_rows = torch.cat([decode_seg_rows, chunk_rows.to(device)])
    padded_pos = torch.cat([positions, positions.new_full((1,), PAD_QUERY_POSITION)])
    chunk_loops = torch.tensor([c.loop for c in out.prefill_chunks], dtype=torch.int64)
    chunk_slots = torch.tensor([c.slot for c in out.prefill_chunks], dtype=torch.int64)
    return PassRows(
        slots=slots,
        positions=positions,
        loops=loops,
        write_hi=write_hi,
        seg_rows=seg_rows,
        seg_q_pos=padded_pos[seg_rows],
        seg_slots=torch.cat([decode, chunk_slots.to(device)]),
        seg_loops=torch.cat([d_loops, chunk_loops.to(device)]),
    )


def build_metadata(
    rows: PassRows, state: SlotState, geo: KVGeometry, max_context: int, with_segments: bool
) -> AttentionMetadata:
    """Flat cache indices: plane * slots_per_plane + block * block_size + offset."""
    bs, spp = geo.block_size, geo.slots_per_plane
    shared = geo.planes == 1
    meta = AttentionMetadata(
        positions=rows.positions,
        row_slots=rows.slots,
        read_plane=torch.zeros_like(rows.loops) if shared else rows.loops,
        write_lo=torch.zeros_like(rows.loops) if shared else rows.loops,
        write_hi=torch.ones_like(rows.loops) if shared else rows.write_hi,
        row_entry=state.block_table[rows.slots, rows.positions // bs] * bs + rows.positions % bs,
        block_table=state.block_table,
        planes=geo.planes,
        slots_per_plane=spp,
        block_size=bs,
        dummy_entry=geo.dummy_index,
    )
    if with_segments:
        meta.segments = _segments(rows, state, geo, max_context)
    return meta


def _segments(rows: PassRows, state: SlotState, geo: KVGeometry, max_context: int) -> Segments:
    bs = geo.block_size
    device = rows.positions.device
    kv_pos = torch.arange(max(max_context, 1), device=device)  # [max_kv]
    blocks = state.block_table[rows.seg_slots][:, kv_pos // bs]  # [segs, max_kv]
    read_plane = torch.zeros_like(rows.seg_loops) if geo.planes == 1 else rows.seg_loops
    kv_index = read_plane.unsqueeze(1) * geo.slots_per_plane + blocks * bs + kv_pos % bs
    last_q = rows.seg_q_pos.masked_fill(rows.seg_q_pos == PAD_QUERY_POSITION, -1).amax(dim=1)
    kv_positions = torch.where(
        kv_pos.unsqueeze(0) <= last_q.unsqueeze(1), kv_pos.unsqueeze(0), PAD_KEY_POSITION
    )
    return Segments(
        rows=rows.seg_rows, q_pos=rows.seg_q_pos, kv_index=kv_index, kv_pos=kv_positions
    )
