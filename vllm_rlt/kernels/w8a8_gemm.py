"""FP8 tensor-core products for passes of 2-512 rows with tiles sized for them: cuBLAS's
FP8 kernels tile for many rows, and at 64 rows on Ouro-1.4B shapes they ran at 0.2-0.45 of
the copy bandwidth (the attention output and down projections slower than bf16's). Here a
program owns one output tile, reads its activations already in float8 (`Fp8Rows`, scaled
per token in the epilogue of the kernel before) and its weight tile in float8, and applies
both scales to the float32 accumulator. On sm_90 Triton lets the tensor cores accumulate an
FP8 dot chain in their reduced precision for the whole K loop; a tile with `promote` adds
each K chunk's product into the float32 sum instead (cuBLAS's and DeepSeek-V3's recipe),
at the cost of a second accumulator. Narrow products (o, down) may split K: the float32
partial sums go to the residual add + norms kernel, which adds them in a fixed order, so
more SMs stream the weight and no reduction kernel runs. Products whose consumer needs the
finished product (qkv, gate/up with its SiLU-mul) may split K with `reduce`: each slice
stores its partial sums, counts itself done on the tile's counter, and the slice that
finishes last sums all of them in slice order (the same bits whichever finishes last),
applies the epilogue and sets the counter back to zero for the next launch or replay."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm_rlt.kernels.fp8_rows import Fp8Rows
from vllm_rlt.kernels.pdl import launch_options, pdl_enter
from vllm_rlt.kernels.silu_mul import silu_times_pairs
from vllm_rlt.kernels.w8a8_tile import W8A8Tile
from vllm_rlt.layers.fp8 import Fp8Weight


@triton.jit
def _w8a8_kernel(
    a_ptr,  # [M, K] float8
    b_ptr,  # [N, K] float8: the weight
    a_scale_ptr,  # [M] float32
    b_scale_ptr,  # [N] float32
    c_ptr,  # [M, N] (SILU_MUL: [M, N / 2]) in the activations' dtype, or [SPLIT_K, M, N]
    # float32 partial sums
    part_ptr,  # REDUCE: [SPLIT_K, M, N] float32, the slices' partial sums
    count_ptr,  # REDUCE: int32 per output tile, zero between launches
    M,
    N,
    K: tl.constexpr,
    K_ITERS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    SILU_MUL: tl.constexpr,
    REDUCE: tl.constexpr,
    IMPRECISE_K: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """One output tile over K slice program_id(1) (K_ITERS chunks). The scales are linear
    in the sum, so each slice applies them and the slices sum to the scaled product. With
    SILU_MUL (one slice; weight rows interleave gate and up) the tile's pairs leave as
    SiLU(gate) * up, rounded where the torch reference rounds. With REDUCE the slices are
    summed here by the last to finish (the module's docstring). IMPRECISE_K: how many K
    elements the tensor cores may sum in reduced precision (None: Triton's default)."""
    pdl_enter(USE_PDL)
    tiles_n = tl.cdiv(N, BLOCK_N)
    pid = tl.program_id(0)
    split = tl.program_id(1)
    rows = (pid // tiles_n) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = (pid % tiles_n) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < M
    col_ok = cols < N
    k_start = split * (K_ITERS * BLOCK_K)
    ks = tl.arange(0, BLOCK_K)
    a_rows = a_ptr + rows[:, None].to(tl.int64) * K
    b_cols = b_ptr + cols[None, :].to(tl.int64) * K
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for i in range(K_ITERS):
        k = k_start + i * BLOCK_K + ks
        a = tl.load(a_rows + k[None, :], mask=row_ok[:, None] & (k < K)[None, :], other=0.0)
        b = tl.load(b_cols + k[:, None], mask=col_ok[None, :] & (k < K)[:, None], other=0.0)
        acc = tl.dot(a, b, acc, max_num_imprecise_acc=IMPRECISE_K)
    a_scale = tl.load(a_scale_ptr + rows, mask=row_ok, other=0.0)
    b_scale = tl.load(b_scale_ptr + cols, mask=col_ok, other=0.0)
    acc = acc * a_scale[:, None] * b_scale[None, :]
    if REDUCE:
        tile_ok = row_ok[:, None] & col_ok[None, :]
        parts = part_ptr + rows[:, None].to(tl.int64) * N + cols[None, :]
        tl.store(parts + split.to(tl.int64) * M * N, acc, mask=tile_ok)
        tl.debug_barrier()  # every thread's partial sums are stored before the count
        if tl.atomic_add(count_ptr + pid, 1, sem="acq_rel", scope="gpu") == SPLIT_K - 1:
            acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
            for s in range(SPLIT_K):  # in slice order: the same bits whoever sums
                part = parts + tl.cast(s, tl.int64) * M * N
                acc += tl.load(part, mask=tile_ok, other=0.0, cache_modifier=".cg")
            tl.store(count_ptr + pid, 0)
            _store_tile(
                acc, c_ptr, rows, cols, row_ok, col_ok, N, pid, tiles_n, BLOCK_M, BLOCK_N, SILU_MUL
            )
    else:  # one slice's partial sums go to slice `split` of c ([SPLIT_K, M, N])
        c_slice = c_ptr + split.to(tl.int64) * M * N if SPLIT_K > 1 else c_ptr
        _store_tile(
            acc, c_slice, rows, cols, row_ok, col_ok, N, pid, tiles_n, BLOCK_M, BLOCK_N, SILU_MUL
        )


@triton.jit
def _store_tile(
    acc,
    c_ptr,
    rows,
    cols,
    row_ok,
    col_ok,
    N,
    pid,
    tiles_n,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SILU_MUL: tl.constexpr,
):
    """The tile's epilogue: SiLU(gate) * up of its pairs ([M, N / 2] at c_ptr), or the
    tile itself ([M, N] at c_ptr) in c's dtype."""
    dtype = c_ptr.dtype.element_ty
    if SILU_MUL:
        act = silu_times_pairs(acc, BLOCK_M, BLOCK_N, dtype)
        half = (pid % tiles_n) * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        out = c_ptr + rows[:, None].to(tl.int64) * (N // 2) + half[None, :]
        tl.store(out, act, mask=row_ok[:, None] & (half < N // 2)[None, :])
    else:
        out = c_ptr + rows[:, None].to(tl.int64) * N + cols[None, :]
        tl.store(out, acc.to(dtype), mask=row_ok[:, None] & col_ok[None, :])


def w8a8_gemm(
    x: Fp8Rows, weight: Fp8Weight, tile: W8A8Tile, silu_mul: bool = False, pdl: bool = False
) -> torch.Tensor:
    """x @ weight.T: [rows, N] in x.dtype, or with tile.split_k > 1 (and not tile.reduce)
    the [split_k, rows, N] float32 partial sums, or with silu_mul SiLU(gate) * up
    ([rows, N / 2]); graph-safe."""
    m, k = x.shape
    n = weight.shape[0]
    device = x.data.device
    partials = tile.split_k > 1 and not tile.reduce
    if silu_mul and (n % 2 or partials):
        raise ValueError(f"w8a8_gemm: silu_mul needs an even N and the finished product, got N={n}")
    if silu_mul:
        out = torch.empty(m, n // 2, dtype=x.dtype, device=device)
    elif partials:
        out = torch.empty(tile.split_k, m, n, dtype=torch.float32, device=device)
    else:
        out = torch.empty(m, n, dtype=x.dtype, device=device)
    tiles = triton.cdiv(m, tile.block_m) * triton.cdiv(n, tile.block_n)
    reduce = tile.reduce and tile.split_k > 1
    parts = torch.empty(tile.split_k, m, n, dtype=torch.float32, device=device) if reduce else out
    if m:
        _w8a8_kernel[(tiles, tile.split_k)](
            x.data,
            weight.data,
            x.scale,
            weight.scale,
            out,
            parts,
            _tile_counters(device, tiles) if reduce else x.scale,
            m,
            n,
            K=k,
            K_ITERS=triton.cdiv(k, tile.split_k * tile.block_k),
            BLOCK_M=tile.block_m,
            BLOCK_N=tile.block_n,
            BLOCK_K=tile.block_k,
            SPLIT_K=tile.split_k,
            SILU_MUL=silu_mul,
            REDUCE=reduce,
            IMPRECISE_K=tile.block_k if tile.promote else None,
            num_warps=tile.warps,
            num_stages=tile.stages,
            **launch_options(pdl),
        )
    return out


_COUNTERS: dict[torch.device, torch.Tensor] = {}


def _tile_counters(device: torch.device, tiles: int) -> torch.Tensor:
    """int32 counters, one per output tile, zero between launches (each launch leaves them
    zero), shared by every reducing product on the device: those run one after another in
    the stream, each kernel waiting for the one before (PDL included)."""
    counters = _COUNTERS.get(device)
    if counters is None or counters.numel() < tiles:
        counters = torch.zeros(max(tiles, 1 << 14), dtype=torch.int32, device=device)
        _COUNTERS[device] = counters
    return counters
