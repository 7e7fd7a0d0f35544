"""Prefill attention over tiles of consecutive prompt positions of one request and plane,
with tl.dot and causal masking. A head lies on a power-of-two range of lanes, masked past
its end (kernels/head_lanes.py).

Rounding follows the torch reference step by step (each bf16 product and sum is rounded
where torch rounds it), so the Triton and torch backends differ only by reduction order.
"""

from __future__ import annotations

import triton
import triton.language as tl

from vllm_rlt.kernels.head_lanes import real_lanes, with_lanes
from vllm_rlt.kernels.pdl import pdl_enter


@triton.jit(do_not_specialize=["tile_stride"])
def _prefill_attention_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,
    v_scale_ptr,
    out_ptr,
    tiles_ptr,
    tile_stride,
    count_ptr,
    block_table_ptr,
    block_table_stride,
    slots_per_plane,
    block_size,
    scale,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_P2: tl.constexpr,
    KV_SCALED: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IEEE: tl.constexpr,
    PERSISTENT: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """A tile of up to BLOCK_M consecutive prompt positions of one request and plane,
    against key tiles of BLOCK_N positions, with tl.dot and causal masking. `tiles_ptr`
    holds the tiles' fields (row, length, position, table, plane) `tile_stride` apart; the
    stride is the tile count, so it is not specialized (one compiled variant for all).
    PERSISTENT: as in the row kernel, the tile count is read from `count_ptr`."""
    pdl_enter(USE_PDL)
    head = tl.program_id(1)
    if PERSISTENT:
        for tile in range(tl.program_id(0), tl.load(count_ptr), tl.num_programs(0)):
            _attend_tile(
                tile,
                head,
                q_ptr,
                k_cache_ptr,
                v_cache_ptr,
                k_scale_ptr,
                v_scale_ptr,
                out_ptr,
                tiles_ptr,
                tile_stride,
                block_table_ptr,
                block_table_stride,
                slots_per_plane,
                block_size,
                scale,
                NUM_HEADS,
                NUM_KV_HEADS,
                HEAD_DIM,
                HEAD_P2,
                KV_SCALED,
                BLOCK_M,
                BLOCK_N,
                IEEE,
            )
    else:
        _attend_tile(
            tl.program_id(0),
            head,
            q_ptr,
            k_cache_ptr,
            v_cache_ptr,
            k_scale_ptr,
            v_scale_ptr,
            out_ptr,
            tiles_ptr,
            tile_stride,
            block_table_ptr,
            block_table_stride,
            slots_per_plane,
            block_size,
            scale,
            NUM_HEADS,
            NUM_KV_HEADS,
            HEAD_DIM,
            HEAD_P2,
            KV_SCALED,
            BLOCK_M,
            BLOCK_N,
            IEEE,
        )


@triton.jit
def _attend_tile(
    tile,
    head,
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,
    v_scale_ptr,
    out_ptr,
    tiles_ptr,
    tile_stride,
    block_table_ptr,
    block_table_stride,
    slots_per_plane,
    block_size,
    scale,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_P2: tl.constexpr,
    KV_SCALED: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IEEE: tl.constexpr,
):
    kv_head = head // (NUM_HEADS // NUM_KV_HEADS)
    row0 = tl.load(tiles_ptr + tile)
    count = tl.load(tiles_ptr + tile_stride + tile)
    pos0 = tl.load(tiles_ptr + 2 * tile_stride + tile)
    table_row = tl.load(tiles_ptr + 3 * tile_stride + tile)
    plane = tl.load(tiles_ptr + 4 * tile_stride + tile)
    m = tl.arange(0, BLOCK_M)
    d = tl.arange(0, HEAD_P2)
    lanes = real_lanes(d, HEAD_DIM, HEAD_P2)  # padded lanes: q, K and V read 0, never stored
    rows_valid = with_lanes((m < count)[:, None], lanes)
    q_offsets = ((row0 + m)[:, None] * NUM_HEADS + head) * HEAD_DIM + d[None, :]
    q = tl.load(q_ptr + q_offsets, mask=rows_valid, other=0.0)
    q_pos = pos0 + m
    if KV_SCALED:  # a float8 cache holds K / k_scale and V / v_scale
        scale = scale * tl.load(k_scale_ptr + kv_head)
    row_max = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    row_sum = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, HEAD_P2), tl.float32)
    context = pos0 + count
    for start in tl.range(0, context, BLOCK_N):
        j = start + tl.arange(0, BLOCK_N)
        keys_valid = j < context
        kv_mask = with_lanes(keys_valid[:, None], lanes)
        block = tl.load(
            block_table_ptr + table_row * block_table_stride + j // block_size,
            mask=keys_valid,
            other=0,
        )
        entry = (plane * slots_per_plane + block * block_size + j % block_size) * NUM_KV_HEADS
        offsets = (entry + kv_head)[:, None] * HEAD_DIM + d[None, :]
        # a float8 cache is widened to q's dtype here, as it is read
        k = tl.load(k_cache_ptr + offsets, mask=kv_mask, other=0.0).to(q.dtype)
        if IEEE:
            scores = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            scores = tl.dot(q, tl.trans(k))
        scores = scores * scale
        visible = (j[None, :] <= q_pos[:, None]) & keys_valid[None, :]
        scores = tl.where(visible, scores, float("-inf"))
        new_max = tl.maximum(row_max, tl.max(scores, axis=1))
        new_max = tl.where(new_max == float("-inf"), 0.0, new_max)
        p = tl.exp(scores - new_max[:, None])
        alpha = tl.exp(row_max - new_max)
        row_sum = row_sum * alpha + tl.sum(p, axis=1)
        v = tl.load(v_cache_ptr + offsets, mask=kv_mask, other=0.0).to(q.dtype)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        row_max = new_max
    out = acc / tl.where(row_sum == 0.0, 1.0, row_sum)[:, None]
    if KV_SCALED:
        out = out * tl.load(v_scale_ptr + kv_head)
    tl.store(out_ptr + q_offsets, out.to(out_ptr.dtype.element_ty), mask=rows_valid)
