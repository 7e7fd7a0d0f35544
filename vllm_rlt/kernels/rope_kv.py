"""RoPE fused with the KV write: rotate q and k, and write k and v into the planes each
row owns (divided by the K/V scales under a float8 cache). A head (and each rotated half)
lies on a power-of-two range of lanes, masked past its end (kernels/head_lanes.py).

Rounding follows the torch reference step by step (each bf16 product and sum is rounded
where torch rounds it), so the Triton and torch backends differ only by reduction order.
"""

from __future__ import annotations

import triton
import triton.language as tl

from vllm_rlt.kernels.head_lanes import load_lanes, real_lanes, with_lanes
from vllm_rlt.kernels.pdl import pdl_enter


@triton.jit
def rotate_halves(x1, x2, cos, sin, dtype):
    """rotate-half RoPE on the two halves, rounding each product like torch."""
    out1 = ((x1 * cos).to(dtype).to(tl.float32) + (-x2 * sin).to(dtype).to(tl.float32)).to(dtype)
    out2 = ((x2 * cos).to(dtype).to(tl.float32) + (x1 * sin).to(dtype).to(tl.float32)).to(dtype)
    return out1, out2


@triton.jit
def _kv_scaled(k1, k2, v, k_scale_ptr, v_scale_ptr, kv_head, KV_SCALED: tl.constexpr):
    """The halves of k and v as a float8 cache holds them: divided by their head's scales in
    float32 (round to nearest, as torch divides), or unchanged."""
    if KV_SCALED:
        k_scale = tl.load(k_scale_ptr + kv_head)
        v_scale = tl.load(v_scale_ptr + kv_head)
        k1 = tl.math.div_rn(k1.to(tl.float32), k_scale)
        k2 = tl.math.div_rn(k2.to(tl.float32), k_scale)
        v = tl.math.div_rn(v.to(tl.float32), v_scale)
    return k1, k2, v


@triton.jit
def write_kv(
    qkv_row_ptr,
    k1,
    k2,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,
    v_scale_ptr,
    entry_ptr,
    lo_ptr,
    hi_ptr,
    row,
    kv_head,
    slots_per_plane,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_P2: tl.constexpr,
    KV_SCALED: tl.constexpr,
    PLANES: tl.constexpr,
):
    """Write one row's rotated k halves and its v (read from the row's qkv) of one KV head
    into planes lo..hi-1, as the cache holds them."""
    HALF: tl.constexpr = HEAD_DIM // 2
    HALF_P2: tl.constexpr = HEAD_P2 // 2
    d = tl.arange(0, HALF_P2)
    full = tl.arange(0, HEAD_P2)
    half_lanes = real_lanes(d, HALF, HALF_P2)
    lanes = real_lanes(full, HEAD_DIM, HEAD_P2)
    kv_dtype = k_cache_ptr.dtype.element_ty  # the model's, or float8 (rounded here)
    v = load_lanes(qkv_row_ptr + (NUM_HEADS + NUM_KV_HEADS + kv_head) * HEAD_DIM + full, lanes)
    k1, k2, v = _kv_scaled(k1, k2, v, k_scale_ptr, v_scale_ptr, kv_head, KV_SCALED)
    entry = tl.load(entry_ptr + row)
    lo = tl.load(lo_ptr + row)
    hi = tl.load(hi_ptr + row)
    for plane in tl.static_range(PLANES):
        if (plane >= lo) & (plane < hi):
            dst = ((plane * slots_per_plane + entry) * NUM_KV_HEADS + kv_head) * HEAD_DIM
            tl.store(k_cache_ptr + dst + d, k1.to(kv_dtype), mask=half_lanes)
            tl.store(k_cache_ptr + dst + HALF + d, k2.to(kv_dtype), mask=half_lanes)
            tl.store(v_cache_ptr + dst + full, v.to(kv_dtype), mask=lanes)


@triton.jit
def _rope_write_kernel(
    qkv_ptr,
    q_out_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,
    v_scale_ptr,
    positions_ptr,
    cos_ptr,
    sin_ptr,
    entry_ptr,
    lo_ptr,
    hi_ptr,
    qkv_stride,
    slots_per_plane,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_P2: tl.constexpr,
    PLANES: tl.constexpr,
    KV_SCALED: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """Rotate q into q_out; rotate k and write k, v into planes lo..hi-1 of the cache
    (KV_SCALED: divided by the head's k_scale and v_scale in float32 first)."""
    pdl_enter(USE_PDL)
    row = tl.program_id(0).to(tl.int64)  # row * stride passes 2**31 in large passes
    head = tl.program_id(1)
    HALF: tl.constexpr = HEAD_DIM // 2
    HALF_P2: tl.constexpr = HEAD_P2 // 2
    d = tl.arange(0, HALF_P2)
    lanes = real_lanes(d, HALF, HALF_P2)
    dtype = q_out_ptr.dtype.element_ty
    pos = tl.load(positions_ptr + row)
    cos = load_lanes(cos_ptr + pos * HEAD_DIM + d, lanes).to(tl.float32)
    sin = load_lanes(sin_ptr + pos * HEAD_DIM + d, lanes).to(tl.float32)
    base = qkv_ptr + row * qkv_stride
    x1 = load_lanes(base + head * HEAD_DIM + d, lanes).to(tl.float32)
    x2 = load_lanes(base + head * HEAD_DIM + HALF + d, lanes).to(tl.float32)
    out1, out2 = rotate_halves(x1, x2, cos, sin, dtype)
    if head < NUM_HEADS:
        q_base = q_out_ptr + (row * NUM_HEADS + head) * HEAD_DIM
        tl.store(q_base + d, out1, mask=lanes)
        tl.store(q_base + HALF + d, out2, mask=lanes)
    else:
        write_kv(
            base,
            out1,
            out2,
            k_cache_ptr,
            v_cache_ptr,
            k_scale_ptr,
            v_scale_ptr,
            entry_ptr,
            lo_ptr,
            hi_ptr,
            row,
            head - NUM_HEADS,
            slots_per_plane,
            NUM_HEADS,
            NUM_KV_HEADS,
            HEAD_DIM,
            HEAD_P2,
            KV_SCALED,
            PLANES,
        )


@triton.jit
def _rope_write_rows_kernel(
    qkv_ptr,
    q_out_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,
    v_scale_ptr,
    positions_ptr,
    cos_ptr,
    sin_ptr,
    entry_ptr,
    lo_ptr,
    hi_ptr,
    qkv_stride,
    slots_per_plane,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEADS_P2: tl.constexpr,
    KV_HEADS_P2: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_P2: tl.constexpr,
    PLANES: tl.constexpr,
    KV_SCALED: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """As `_rope_write_kernel`, one program per row for every head: from 64 rows on, a
    program per row and head is too little work each (4-8x slower at 512-1024 rows); below,
    the per-head grid keeps more of the GPU busy."""
    pdl_enter(USE_PDL)
    row = tl.program_id(0).to(tl.int64)  # row * stride passes 2**31 in large passes
    HALF: tl.constexpr = HEAD_DIM // 2
    HALF_P2: tl.constexpr = HEAD_P2 // 2
    d = tl.arange(0, HALF_P2)[None, :]
    full = tl.arange(0, HEAD_P2)[None, :]
    half_lanes = real_lanes(d, HALF, HALF_P2)
    lanes = real_lanes(full, HEAD_DIM, HEAD_P2)
    h = tl.arange(0, HEADS_P2)[:, None]
    kh = tl.arange(0, KV_HEADS_P2)[:, None]
    dtype = q_out_ptr.dtype.element_ty
    kv_dtype = k_cache_ptr.dtype.element_ty  # the model's, or float8 (rounded here)
    pos = tl.load(positions_ptr + row)
    cos = load_lanes(cos_ptr + pos * HEAD_DIM + d, half_lanes).to(tl.float32)
    sin = load_lanes(sin_ptr + pos * HEAD_DIM + d, half_lanes).to(tl.float32)
    base = qkv_ptr + row * qkv_stride
    q_mask = with_lanes(h < NUM_HEADS, half_lanes)
    x1 = tl.load(base + h * HEAD_DIM + d, mask=q_mask).to(tl.float32)
    x2 = tl.load(base + h * HEAD_DIM + HALF + d, mask=q_mask).to(tl.float32)
    out1, out2 = rotate_halves(x1, x2, cos, sin, dtype)
    q_base = q_out_ptr + (row * NUM_HEADS + h) * HEAD_DIM
    tl.store(q_base + d, out1, mask=q_mask)
    tl.store(q_base + HALF + d, out2, mask=q_mask)
    kv_mask = kh < NUM_KV_HEADS
    k_mask = with_lanes(kv_mask, half_lanes)
    v_mask = with_lanes(kv_mask, lanes)
    k_base = base + (NUM_HEADS + kh) * HEAD_DIM
    x1 = tl.load(k_base + d, mask=k_mask).to(tl.float32)
    x2 = tl.load(k_base + HALF + d, mask=k_mask).to(tl.float32)
    out1, out2 = rotate_halves(x1, x2, cos, sin, dtype)
    v = tl.load(base + (NUM_HEADS + NUM_KV_HEADS + kh) * HEAD_DIM + full, mask=v_mask)
    head = tl.minimum(kh, NUM_KV_HEADS - 1)  # padding heads are masked at the store
    out1, out2, v = _kv_scaled(out1, out2, v, k_scale_ptr, v_scale_ptr, head, KV_SCALED)
    entry = tl.load(entry_ptr + row)
    lo = tl.load(lo_ptr + row)
    hi = tl.load(hi_ptr + row)
    for plane in tl.static_range(PLANES):
        if (plane >= lo) & (plane < hi):
            dst = ((plane * slots_per_plane + entry) * NUM_KV_HEADS + kh) * HEAD_DIM
            tl.store(k_cache_ptr + dst + d, out1.to(kv_dtype), mask=k_mask)
            tl.store(k_cache_ptr + dst + HALF + d, out2.to(kv_dtype), mask=k_mask)
            tl.store(v_cache_ptr + dst + full, v.to(kv_dtype), mask=v_mask)
