"""Paged decode attention in CUDA (csrc/paged_attention.cu), for the decode rows that the
Triton row kernel (`_paged_attention_kernel`) would otherwise attend.

A warp takes a row, a KV head with its group of query heads, and a run of keys, alone: it
keeps two tiles of 16 keys and values in flight through cp.async in shared memory of its
own, so a block of four (four KV heads of a row) streams the cache where a Triton program
waits on one tile's load at a time. bf16 queries over a bf16, float8 e4m3 or e5m2 cache
(per-head scales), head sizes 64, 96 and 128, groups of up to 8 query heads; every split and
the bounded grid of a captured pass, with the Triton combine kernel for split runs. Built
on first use (cuda_build.py); without a compiler the Triton kernel serves.
"""

from __future__ import annotations

import ctypes
from typing import Protocol

import torch

from vllm_rlt.kernels.cuda_build import cuda_module
from vllm_rlt.kernels.cuda_driver import CudaModule

# Which decode launches take the kernel, from `python -m benchmarks.probe_paged_attention`
# on an H100 (docs/benchmarks/2026-12-06-h100-warp-per-head-attention.md), one query head
# a KV head: head sizes that are no power of two, which the Triton kernel pads to one
# (Huginn-0125's 96 on 128 lanes: 2.28x in bf16, 1.81x over float8 at 64 rows x 320
# positions; 2.7x at 4 x 4,096), and from ANY_CACHE_ROWS rows any cache (256 and 512 rows x 80
# positions: 1.08-1.11x bf16, 1.26x float8; the engine's bf16 pass at 256 rows 1.04x).
# Below it Triton keeps its launches: at 64 x 80 float8 it reads 1.09x faster, and the
# engine's long-context passes at 32-64 rows lost 6-9% on the kernel. Grouped heads stay
# on Triton's tensor-core tiles (0.72x at Nanbeige's 6 a group). ALL_ROWS: every launch of
# at least so many rows that the kernel fits (0: none beyond the rules above).
PADDED_HEADS = True
ANY_CACHE_ROWS = 256
ALL_ROWS = 0

HEAD_DIMS = (64, 96, 128)
GROUP_TILES = (1, 2, 4, 8)
_KINDS = {torch.bfloat16: "bf16", torch.float8_e4m3fn: "e4m3", torch.float8_e5m2: "e5m2"}
WARPS, TILE, STAGES = 4, 16, 2  # as csrc/paged_attention.cu
# Split-KV for the kernel's launches (decode_splits): 256 blocks, two an SM on an H100.
SPLIT_BLOCKS, MAX_SPLITS = 256, 32

_pointer, _int, _long = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64


class PagedRows(Protocol):
    """What the kernel reads of a pass's attention metadata (ops/metadata.py's
    AttentionMetadata has it): per-row int64 tensors and the cache's geometry."""

    positions: torch.Tensor
    row_tables: torch.Tensor
    read_plane: torch.Tensor
    block_table: torch.Tensor
    slots_per_plane: int
    block_size: int


class AttentionArgs(ctypes.Structure):
    """The kernel's argument, field for field as csrc/paged_attention.cu declares it."""

    _fields_ = [
        *((name, _pointer) for name in ("q", "k_cache", "v_cache", "k_scale", "v_scale")),
        *((name, _pointer) for name in ("out", "parts", "positions", "table_rows", "planes")),
        ("block_table", _pointer),
        ("count", _pointer),
        ("block_table_stride", _long),
        ("slots_per_plane", _long),
        *((name, _int) for name in ("rows", "heads", "kv_heads", "block_size", "splits")),
        ("scaled", _int),
        ("pdl", _int),
        ("scale", ctypes.c_float),
    ]


def _module(device: torch.device) -> CudaModule | None:
    index = device.index if device.index is not None else torch.cuda.current_device()
    return cuda_module("paged_attention", index, min_capability=(8, 0))  # cp.async


def group_tile(num_heads: int, num_kv_heads: int) -> int:
    """The kernel variant's query heads a block (the group padded), or 0 where none fits."""
    if num_kv_heads < 1 or num_heads % num_kv_heads:
        return 0
    group = num_heads // num_kv_heads
    return next((tile for tile in GROUP_TILES if group <= tile), 0)


def head_blocks(num_kv_heads: int) -> int:
    """Blocks a row and run takes: a warp a KV head, four to a block."""
    return -(-num_kv_heads // WARPS)


def decode_splits(rows: int, num_kv_heads: int) -> int:
    """Runs a row's keys are split into (a power of two, at most MAX_SPLITS) until the
    launch has SPLIT_BLOCKS blocks: a warp streams its whole run alone, so fewer blocks
    leave SMs with a warp or none (32 rows x 1,024 float8 positions at 128 blocks read 0.55
    of bandwidth). Fixed by the launch's rows and the model's heads, as a captured graph
    needs."""
    splits = 1
    while splits < MAX_SPLITS and rows * head_blocks(num_kv_heads) * splits < SPLIT_BLOCKS:
        splits *= 2
    return splits


def shared_bytes(head_dim: int, element_bytes: int, tile: int) -> int:
    """A block's dynamic shared memory: each warp's ring of (K, V) tiles, rows padded by 16
    bytes, then each warp's group of queries in float32 (csrc/paged_attention.cu's Layout)."""
    ring = STAGES * 2 * TILE * (head_dim * element_bytes + 16)
    return WARPS * (ring + tile * head_dim * 4)


def takes_cuda_decode(q: torch.Tensor, k_cache: torch.Tensor, num_kv_heads: int, rows: int) -> bool:
    """Whether a decode launch over `rows` row programs attends with the CUDA kernel (see
    PADDED_HEADS)."""
    head_dim = k_cache.shape[-1]
    single = q.shape[1] == num_kv_heads
    padded = PADDED_HEADS and head_dim & (head_dim - 1) != 0
    many = 0 < ANY_CACHE_ROWS <= rows
    wins = (single and (padded or many)) or 0 < ALL_ROWS <= rows
    return wins and fits_cuda_decode(q, k_cache, num_kv_heads)


def fits_cuda_decode(q: torch.Tensor, k_cache: torch.Tensor, num_kv_heads: int) -> bool:
    """Whether the kernel can attend: bf16 queries [rows, heads, head_dim] over a contiguous
    bf16 or float8 cache [entries, kv_heads, head_dim] of a head size and group it was built
    for, slots addressable in 32 bits, on a device it was built for."""
    entries, kv_heads, head_dim = k_cache.shape
    return (
        q.dtype == torch.bfloat16
        and q.is_cuda
        and q.is_contiguous()
        and k_cache.dtype in _KINDS
        and k_cache.is_contiguous()
        and kv_heads == num_kv_heads
        and head_dim in HEAD_DIMS
        and group_tile(q.shape[1], num_kv_heads) > 0
        and entries < 2**31
        and _module(q.device) is not None
    )


def paged_decode(
    q: torch.Tensor,  # [rows, heads, head_dim] bf16, rotated
    caches: tuple[torch.Tensor, ...],  # (k_cache, v_cache, k_scale, v_scale)
    scaled: bool,  # a float8 cache with per-head scales
    out: torch.Tensor,  # [rows, heads, head_dim]
    parts: torch.Tensor,  # [rows, heads, splits, head_dim + 2] float32 (splits > 1)
    meta: PagedRows,
    row_grid: int,  # row programs: the decode rows, or a bounded grid over `count`
    splits: int,
    count: torch.Tensor | None,  # the decode rows on the device (a bounded grid), or None
    scale: float,
    pdl: bool,
) -> None:
    """Attend decode rows 0..rows-1 into `out`, or with splits > 1 each run's state into
    `parts` for the combine kernel; graph-safe."""
    k_cache, v_cache, k_scale, v_scale = caches
    heads, head_dim = q.shape[1], q.shape[2]
    kv_heads = k_cache.shape[1]
    tile = group_tile(heads, kv_heads)
    tensors = (meta.positions, meta.row_tables, meta.read_plane, meta.block_table)
    assert all(t.dtype == torch.int64 for t in tensors) and meta.block_table.stride(1) == 1
    assert v_cache.shape == k_cache.shape and v_cache.dtype == k_cache.dtype
    assert v_cache.is_contiguous()
    if scaled:  # read as float32 [kv_heads]
        for t in (k_scale, v_scale):
            assert t.dtype == torch.float32 and t.numel() == kv_heads and t.is_contiguous()
    args = AttentionArgs(
        q.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        k_scale.data_ptr(),
        v_scale.data_ptr(),
        out.data_ptr(),
        parts.data_ptr(),
        *(t.data_ptr() for t in tensors),
        0 if count is None else count.data_ptr(),
        meta.block_table.stride(0),
        meta.slots_per_plane,
        row_grid,
        heads,
        kv_heads,
        meta.block_size,
        splits,
        int(scaled),
        int(pdl),
        scale,
    )
    name = f"paged_decode_d{head_dim}_{_KINDS[k_cache.dtype]}_g{tile}"
    kernel = _module(q.device).kernel(name)
    stream = torch.cuda.current_stream(q.device).cuda_stream
    shared = shared_bytes(head_dim, k_cache.element_size(), tile)
    grid = (row_grid, head_blocks(kv_heads), splits)  # a warp a KV head
    kernel.launch(grid, WARPS * 32, stream, (args,), pdl=pdl, shared_bytes=shared)
