"""Paged decode attention: a program per row and head (or KV head's group) over its plane's
keys with online softmax, optionally split over runs of key tiles and combined by a second
kernel; and the fused kernel that writes K/V and attends in one launch. A head lies on a
power-of-two range of lanes, masked past its end (kernels/head_lanes.py).

Rounding follows the torch reference step by step (each bf16 product and sum is rounded
where torch rounds it), so the Triton and torch backends differ only by reduction order.
"""

from __future__ import annotations

import triton
import triton.language as tl

from vllm_rlt.kernels.head_lanes import head_range, load_lanes, real_lanes, with_lanes
from vllm_rlt.kernels.pdl import pdl_enter
from vllm_rlt.kernels.rope_kv import rotate_halves, write_kv


def attention_shape(num_heads: int, num_kv_heads: int, head_dim: int, scaled: bool) -> dict:
    """The decode and combine kernels' shape constants (one place, so that the benchmarks'
    direct kernel calls compile the engine's variants)."""
    shape = dict(NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim)
    return shape | dict(HEAD_P2=head_range(head_dim), KV_SCALED=scaled)


@triton.jit
def _rope_attend_kernel(
    qkv_ptr,
    q_out_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,
    v_scale_ptr,
    out_ptr,
    positions_ptr,
    cos_ptr,
    sin_ptr,
    entry_ptr,
    lo_ptr,
    hi_ptr,
    table_rows_ptr,
    planes_ptr,
    block_table_ptr,
    part_ptr,
    qkv_stride,
    block_table_stride,
    slots_per_plane,
    block_size,
    scale,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_P2: tl.constexpr,
    KV_SCALED: tl.constexpr,
    PLANES: tl.constexpr,
    BLOCK_N: tl.constexpr,
    STAGES: tl.constexpr,
    SPLITS: tl.constexpr,
    GROUP_TILE: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """RoPE + KV write and paged attention of one decode row and head in one program, for
    passes whose rows read nothing another row writes (decode without speculation lanes):
    the program rotates its q head into q_out and its KV head's k, writes k and v into
    planes lo..hi-1 (ungrouped, every head of a group writes the same bytes), waits for its
    own threads' writes, then attends as `_paged_attention_kernel` does. One kernel fewer
    per layer, with the same values as the two. With SPLITS > 1 (grid axis 2) each program
    attends one run of key tiles (split-KV, for few rows at long contexts): every split
    rotates and writes the same bytes, and only the split holding `pos` reads them. With
    GROUP_TILE > 0 grid axis 1 runs over KV heads: a program rotates its group's query heads
    together, writes its KV head once, and attends for the group (see `_attend_row`)."""
    pdl_enter(USE_PDL)
    row = tl.program_id(0).to(tl.int64)  # row * stride passes 2**31 in large passes
    head = tl.program_id(1)
    GROUP: tl.constexpr = NUM_HEADS // NUM_KV_HEADS
    HALF: tl.constexpr = HEAD_DIM // 2
    HALF_P2: tl.constexpr = HEAD_P2 // 2
    d = tl.arange(0, HALF_P2)
    lanes = real_lanes(d, HALF, HALF_P2)
    dtype = q_out_ptr.dtype.element_ty
    pos = tl.load(positions_ptr + row)
    cos = load_lanes(cos_ptr + pos * HEAD_DIM + d, lanes).to(tl.float32)
    sin = load_lanes(sin_ptr + pos * HEAD_DIM + d, lanes).to(tl.float32)
    base = qkv_ptr + row * qkv_stride
    if GROUP_TILE:
        kv_head = head
        g = tl.arange(0, GROUP_TILE)
        heads = kv_head * GROUP + g
        g_ok = with_lanes((g < GROUP)[:, None], lanes)
        q_offsets = heads[:, None] * HEAD_DIM + d[None, :]
        q1 = tl.load(base + q_offsets, mask=g_ok, other=0.0).to(tl.float32)
        q2 = tl.load(base + q_offsets + HALF, mask=g_ok, other=0.0).to(tl.float32)
        q1, q2 = rotate_halves(q1, q2, cos[None, :], sin[None, :], dtype)
        q_base = q_out_ptr + row * NUM_HEADS * HEAD_DIM + q_offsets
        tl.store(q_base, q1, mask=g_ok)
        tl.store(q_base + HALF, q2, mask=g_ok)
    else:
        kv_head = head // GROUP
        q1 = load_lanes(base + head * HEAD_DIM + d, lanes).to(tl.float32)
        q2 = load_lanes(base + head * HEAD_DIM + HALF + d, lanes).to(tl.float32)
        q1, q2 = rotate_halves(q1, q2, cos, sin, dtype)
        q_base = q_out_ptr + (row * NUM_HEADS + head) * HEAD_DIM
        tl.store(q_base + d, q1, mask=lanes)
        tl.store(q_base + HALF + d, q2, mask=lanes)
    k_base = base + (NUM_HEADS + kv_head) * HEAD_DIM
    k1 = load_lanes(k_base + d, lanes).to(tl.float32)
    k2 = load_lanes(k_base + HALF + d, lanes).to(tl.float32)
    k1, k2 = rotate_halves(k1, k2, cos, sin, dtype)
    write_kv(
        base,
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
        NUM_HEADS,
        NUM_KV_HEADS,
        HEAD_DIM,
        HEAD_P2,
        KV_SCALED,
        PLANES,
    )
    tl.debug_barrier()  # this program's stores are visible to all its threads
    _attend_row(
        row,
        head,
        q_out_ptr,
        k_cache_ptr,
        v_cache_ptr,
        k_scale_ptr,
        v_scale_ptr,
        out_ptr,
        positions_ptr,
        table_rows_ptr,
        planes_ptr,
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
        BLOCK_N,
        STAGES,
        tl.program_id(2),
        part_ptr,
        SPLITS,
        GROUP_TILE,
    )


@triton.jit
def _paged_attention_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,
    v_scale_ptr,
    out_ptr,
    positions_ptr,
    table_rows_ptr,
    planes_ptr,
    block_table_ptr,
    count_ptr,
    block_table_stride,
    slots_per_plane,
    block_size,
    scale,
    part_ptr,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_P2: tl.constexpr,
    KV_SCALED: tl.constexpr,
    BLOCK_N: tl.constexpr,
    STAGES: tl.constexpr,
    SPLITS: tl.constexpr,
    GROUP_TILE: tl.constexpr,
    PERSISTENT: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """One query row and head over positions 0..pos of its plane, with online softmax.
    PERSISTENT: the row count is read from `count_ptr` on the device and each program
    takes every grid-th row, so a captured pass bounds its grid, not its rows (one split).
    Otherwise SPLITS > 1 splits the row's key tiles into runs along grid axis 2, as in
    `_rope_attend_kernel`. GROUP_TILE > 0: grid axis 1 runs over KV heads, each program
    attending for the KV head's whole group of query heads (see `_attend_row`)."""
    pdl_enter(USE_PDL)
    head = tl.program_id(1)
    if PERSISTENT:
        for row in range(tl.program_id(0), tl.load(count_ptr), tl.num_programs(0)):
            _attend_row(
                tl.cast(row, tl.int64),
                head,
                q_ptr,
                k_cache_ptr,
                v_cache_ptr,
                k_scale_ptr,
                v_scale_ptr,
                out_ptr,
                positions_ptr,
                table_rows_ptr,
                planes_ptr,
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
                BLOCK_N,
                STAGES,
                0,
                out_ptr,  # not read: one split
                1,
                GROUP_TILE,
            )
    else:
        _attend_row(
            tl.program_id(0).to(tl.int64),
            head,
            q_ptr,
            k_cache_ptr,
            v_cache_ptr,
            k_scale_ptr,
            v_scale_ptr,
            out_ptr,
            positions_ptr,
            table_rows_ptr,
            planes_ptr,
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
            BLOCK_N,
            STAGES,
            tl.program_id(2),
            part_ptr,
            SPLITS,
            GROUP_TILE,
        )


@triton.jit
def _attend_row(
    row,  # int64: row * stride passes 2**31 in large passes
    head,
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,
    v_scale_ptr,
    out_ptr,
    positions_ptr,
    table_rows_ptr,
    planes_ptr,
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
    BLOCK_N: tl.constexpr,
    STAGES: tl.constexpr,
    split,
    part_ptr,
    SPLITS: tl.constexpr,
    GROUP_TILE: tl.constexpr,
):
    """Online softmax of one row and head over positions 0..pos of its plane. With SPLITS >
    1 this program takes the split-th of SPLITS equal runs of key tiles and stores its
    unnormalised state (acc, running max, running sum) at part_ptr for
    `_combine_splits_kernel`; an empty run stores (0, -inf, 0). With GROUP_TILE > 0 `head`
    is a KV head, and its group of query heads (padded to GROUP_TILE rows, at least 16)
    attends together with tl.dot, so each K/V tile is read once for the group."""
    GROUP: tl.constexpr = NUM_HEADS // NUM_KV_HEADS
    d = tl.arange(0, HEAD_P2)
    lanes = real_lanes(d, HEAD_DIM, HEAD_P2)  # padded lanes: q, K and V read 0, never stored
    pos = tl.load(positions_ptr + row)
    table_row = tl.load(table_rows_ptr + row)
    plane = tl.load(planes_ptr + row)
    if GROUP_TILE:
        kv_head = head
        g = tl.arange(0, GROUP_TILE)
        g_ok = g < GROUP
        heads = kv_head * GROUP + tl.minimum(g, GROUP - 1)  # padding repeats a head, unstored
        q = load_lanes(q_ptr + (row * NUM_HEADS + heads)[:, None] * HEAD_DIM + d[None, :], lanes)
        m = tl.full((GROUP_TILE,), float("-inf"), tl.float32)
        total = tl.zeros((GROUP_TILE,), tl.float32)
        acc = tl.zeros((GROUP_TILE, HEAD_P2), tl.float32)
    else:
        kv_head = head // GROUP
        q = load_lanes(q_ptr + (row * NUM_HEADS + head) * HEAD_DIM + d, lanes).to(tl.float32)
        m = tl.full((), float("-inf"), tl.float32)
        total = tl.full((), 0.0, tl.float32)
        acc = tl.zeros((HEAD_P2,), tl.float32)
    if KV_SCALED:  # a float8 cache holds K / k_scale and V / v_scale
        scale = scale * tl.load(k_scale_ptr + kv_head)
    first = 0
    context = pos + 1
    if SPLITS > 1:
        run = tl.cdiv(tl.cdiv(pos + 1, BLOCK_N), SPLITS) * BLOCK_N
        first = split * run
        context = tl.minimum(first + run, pos + 1)
    for start in tl.range(first, context, BLOCK_N, num_stages=STAGES):
        j = start + tl.arange(0, BLOCK_N)
        valid = j < context
        block = tl.load(
            block_table_ptr + table_row * block_table_stride + j // block_size, mask=valid, other=0
        )
        entry = (
            plane * slots_per_plane + block * block_size + j % block_size
        ) * NUM_KV_HEADS + kv_head
        offsets = entry[:, None] * HEAD_DIM + d[None, :]
        kv_mask = with_lanes(valid[:, None], lanes)
        if GROUP_TILE:  # float8 K/V widen exactly to q's dtype for the dots
            k = tl.load(k_cache_ptr + offsets, mask=kv_mask, other=0.0).to(q.dtype)
            scores = _dot_f32(q, tl.trans(k)) * scale
            scores = tl.where(valid[None, :], scores, float("-inf"))
            m_new = tl.maximum(m, tl.max(scores, axis=1))
            p = tl.exp(scores - m_new[:, None])
            alpha = tl.exp(m - m_new)
            v = tl.load(v_cache_ptr + offsets, mask=kv_mask, other=0.0).to(q.dtype)
            total = total * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + _dot_f32(p.to(q.dtype), v)
        else:
            k = tl.load(k_cache_ptr + offsets, mask=kv_mask, other=0.0).to(tl.float32)
            scores = tl.sum(k * q[None, :], axis=1) * scale
            scores = tl.where(valid, scores, float("-inf"))
            m_new = tl.maximum(m, tl.max(scores, axis=0))
            p = tl.exp(scores - m_new)
            alpha = tl.exp(m - m_new)
            v = tl.load(v_cache_ptr + offsets, mask=kv_mask, other=0.0).to(tl.float32)
            total = total * alpha + tl.sum(p, axis=0)
            acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
        m = m_new
    if GROUP_TILE:
        _store_group(
            row,
            heads,
            g_ok,
            acc,
            m,
            total,
            v_scale_ptr,
            kv_head,
            out_ptr,
            part_ptr,
            split,
            NUM_HEADS,
            HEAD_DIM,
            HEAD_P2,
            KV_SCALED,
            SPLITS,
        )
    elif SPLITS > 1:
        part = part_ptr + ((row * NUM_HEADS + head) * SPLITS + split) * (HEAD_DIM + 2)
        tl.store(part + d, acc, mask=lanes)
        tl.store(part + HEAD_DIM, m)
        tl.store(part + HEAD_DIM + 1, total)
    else:
        out = acc / total
        if KV_SCALED:
            out = out * tl.load(v_scale_ptr + kv_head)
        out_offsets = (row * NUM_HEADS + head) * HEAD_DIM + d
        tl.store(out_ptr + out_offsets, out.to(out_ptr.dtype.element_ty), mask=lanes)


@triton.jit
def _dot_f32(a, b):
    """a @ b summed in float32; float32 operands multiply exactly (no TF32)."""
    if a.dtype == tl.float32:
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def _store_group(
    row,
    heads,
    g_ok,
    acc,
    m,
    total,
    v_scale_ptr,
    kv_head,
    out_ptr,
    part_ptr,
    split,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_P2: tl.constexpr,
    KV_SCALED: tl.constexpr,
    SPLITS: tl.constexpr,
):
    """A head group's results, as `_attend_row` stores one head's: the split's state, or
    the normalised output."""
    d = tl.arange(0, HEAD_P2)
    tile_ok = with_lanes(g_ok[:, None], real_lanes(d, HEAD_DIM, HEAD_P2))
    if SPLITS > 1:
        part = part_ptr + ((row * NUM_HEADS + heads) * SPLITS + split) * (HEAD_DIM + 2)
        tl.store(part[:, None] + d[None, :], acc, mask=tile_ok)
        tl.store(part + HEAD_DIM, m, mask=g_ok)
        tl.store(part + HEAD_DIM + 1, total, mask=g_ok)
    else:
        out = acc / total[:, None]
        if KV_SCALED:
            out = out * tl.load(v_scale_ptr + kv_head)
        out_offsets = (row * NUM_HEADS + heads)[:, None] * HEAD_DIM + d[None, :]
        tl.store(out_ptr + out_offsets, out.to(out_ptr.dtype.element_ty), mask=tile_ok)


@triton.jit
def _combine_splits_kernel(
    part_ptr,
    v_scale_ptr,
    out_ptr,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_P2: tl.constexpr,
    KV_SCALED: tl.constexpr,
    SPLITS: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """One row and head of split-KV attention: the SPLITS runs' states rescaled to their
    common maximum and summed (empty runs weigh exp(-inf) = 0), then normalised."""
    pdl_enter(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    d = tl.arange(0, HEAD_P2)
    lanes = real_lanes(d, HEAD_DIM, HEAD_P2)
    part = part_ptr + ((row * NUM_HEADS + head) * SPLITS + tl.arange(0, SPLITS)) * (HEAD_DIM + 2)
    m = tl.load(part + HEAD_DIM)
    weight = tl.exp(m - tl.max(m, axis=0))
    total = tl.sum(tl.load(part + HEAD_DIM + 1) * weight, axis=0)
    acc = tl.sum(load_lanes(part[:, None] + d[None, :], lanes) * weight[:, None], axis=0)
    out = acc / total
    if KV_SCALED:
        out = out * tl.load(v_scale_ptr + head // (NUM_HEADS // NUM_KV_HEADS))
    out_offsets = (row * NUM_HEADS + head) * HEAD_DIM + d
    tl.store(out_ptr + out_offsets, out.to(out_ptr.dtype.element_ty), mask=lanes)
