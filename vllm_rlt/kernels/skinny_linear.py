"""Linear layers for few rows (decode passes): each program streams a strip of weight rows
once, so the pass is bounded by weight bandwidth rather than by a GEMM tiled for many rows.

Three things ride along:
- the MLP's SiLU-and-multiply as the epilogue of the gate/up projection (its weight rows
  interleave gate and up, so every strip of output columns holds matching pairs);
- a per-row "live" mask for the LM head, so a pass in which no row exits skips reading the
  head's weights (its logits are then zero and unused);
- split-K for narrow, deep layers (o and down feed a residual add and norm): the K range is
  cut into slices whose float32 partial sums the norm kernel adds up in a fixed order, so
  more SMs stream the weight and no separate reduction kernel runs;
- FP8 weights (layers/fp8.py): the tile is widened to the activations' dtype in registers
  (float8 e4m3 values are exact there) and the accumulator is scaled per output column, so
  the weight crosses memory at one byte per element.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from vllm_rlt.kernels.pdl import launch_options, pdl_enter
from vllm_rlt.kernels.silu_mul import silu_times_pairs
from vllm_rlt.layers.fp8 import Fp8Weight


@dataclass(frozen=True)
class SkinnyConfig:
    """Launch shape: weight rows per program, K chunk, warps, pipeline stages, rows per tile
    (16, tl.dot's smallest, up to 64; fewer rows are masked, not padded in memory), and the
    number of K slices (1: the finished output)."""

    block_n: int = 32
    block_k: int = 256
    warps: int = 4
    stages: int = 4
    block_m: int = 16
    split_k: int = 1


@triton.jit
def _skinny_linear_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    live_ptr,
    scale_ptr,
    M,
    N,
    x_stride,
    out_stride,
    split_stride,
    K: tl.constexpr,
    K_ITERS: tl.constexpr,
    SILU_MUL: tl.constexpr,
    PARTIAL: tl.constexpr,
    SKIP_IDLE: tl.constexpr,
    W_SCALED: tl.constexpr,
    IEEE: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    STAGES: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """y[m, n] = sum_k x[m, k] * w[n, k] over this program's K slice (K_ITERS chunks).
    PARTIAL stores the float32 slice sum at slice program_id(2); otherwise, with SILU_MUL,
    out[m, j] = silu(y[m, 2j]) * y[m, 2j + 1] (rounded like the unfused torch ops), else
    out = y. With SKIP_IDLE, a row tile none of whose rows is live reads no weights and
    writes zeros. With W_SCALED the weight is float8 and y[m, n] is scaled by scale[n]."""
    pdl_enter(USE_PDL)
    pid_n = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    k_first = tl.program_id(2) * (K_ITERS * BLOCK_K)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < M
    col_ok = cols < N
    dtype = out_ptr.dtype.element_ty
    iters = K_ITERS
    if SKIP_IDLE:
        live = tl.load(live_ptr + rows, mask=row_ok, other=0).to(tl.int32)
        iters = tl.max(live, axis=0) * K_ITERS  # live is 0 or 1
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for i in tl.range(0, iters, num_stages=STAGES):
        ks = k_first + i * BLOCK_K + tl.arange(0, BLOCK_K)
        x_offsets = rows[:, None] * x_stride + ks[None, :]
        w_offsets = cols[:, None] * K + ks[None, :]
        if EVEN_K:
            x = tl.load(x_ptr + x_offsets, mask=row_ok[:, None], other=0.0)
            w = tl.load(w_ptr + w_offsets, mask=col_ok[:, None], other=0.0)
        else:
            k_ok = (ks < K)[None, :]
            x = tl.load(x_ptr + x_offsets, mask=row_ok[:, None] & k_ok, other=0.0)
            w = tl.load(w_ptr + w_offsets, mask=col_ok[:, None] & k_ok, other=0.0)
        if W_SCALED:
            w = w.to(x.dtype)
        if IEEE:
            acc = tl.dot(x, tl.trans(w), acc, input_precision="ieee")
        else:
            acc = tl.dot(x, tl.trans(w), acc)
    if W_SCALED:
        acc = acc * tl.load(scale_ptr + cols, mask=col_ok, other=0.0)[None, :]
    if PARTIAL:
        out_offsets = tl.program_id(2) * split_stride + rows[:, None] * out_stride + cols[None, :]
        tl.store(out_ptr + out_offsets, acc, mask=row_ok[:, None] & col_ok[None, :])
    elif SILU_MUL:
        out = silu_times_pairs(acc, BLOCK_M, BLOCK_N, dtype)
        half = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        out_offsets = rows[:, None] * out_stride + half[None, :]
        tl.store(out_ptr + out_offsets, out, mask=row_ok[:, None] & (half < N // 2)[None, :])
    else:
        out_offsets = rows[:, None] * out_stride + cols[None, :]
        tl.store(out_ptr + out_offsets, acc.to(dtype), mask=row_ok[:, None] & col_ok[None, :])


def _check(x: torch.Tensor, weight: torch.Tensor | Fp8Weight) -> None:
    if isinstance(weight, Fp8Weight):
        weight = weight.data
    k = weight.shape[1]
    if x.stride(-1) != 1 or weight.stride(-1) != 1 or weight.stride(0) != k:
        raise ValueError("skinny_linear needs row-major x and a contiguous weight")
    if x.shape[1] != k:
        raise ValueError(f"skinny_linear: x has {x.shape[1]} columns for a weight of K={k}")


def _launch(x, weight, out, config: SkinnyConfig, silu_mul: bool, live, pdl: bool) -> None:
    rows = x.shape[0]
    n, k = weight.shape
    weight, scale = weight.tensors() if isinstance(weight, Fp8Weight) else (weight, None)
    partial = config.split_k > 1
    k_iters = triton.cdiv(triton.cdiv(k, config.block_k), config.split_k)
    grid = (triton.cdiv(n, config.block_n), triton.cdiv(rows, config.block_m), config.split_k)
    _skinny_linear_kernel[grid](
        x,
        weight,
        out,
        x if live is None else live,
        x if scale is None else scale,
        rows,
        n,
        x.stride(0),
        out.stride(-2),
        out.stride(0) if partial else 0,
        K=k,
        K_ITERS=k_iters,
        SILU_MUL=silu_mul,
        PARTIAL=partial,
        SKIP_IDLE=live is not None,
        W_SCALED=scale is not None,
        IEEE=x.dtype == torch.float32,
        EVEN_K=k % (config.block_k * config.split_k) == 0,
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        STAGES=config.stages,
        num_warps=config.warps,
        **launch_options(pdl),
    )


def skinny_linear(
    x: torch.Tensor,  # [rows, K]
    weight: torch.Tensor | Fp8Weight,  # [N, K], contiguous; with silu_mul rows interleave gate, up
    config: SkinnyConfig,
    silu_mul: bool = False,
    live: torch.Tensor | None = None,  # [rows] bool: rows whose output is used
    pdl: bool = False,  # launch as a programmatic dependent (see kernels/pdl.py)
) -> torch.Tensor:
    """x @ weight.T ([rows, N]), or its SiLU-mul ([rows, N / 2]), for few rows; graph-safe."""
    _check(x, weight)
    n = weight.shape[0]
    if config.split_k != 1:
        raise ValueError("skinny_linear gives finished outputs: use skinny_linear_partials")
    if silu_mul and n % 2:
        raise ValueError(f"skinny_linear: silu_mul needs an even N, got {n}")
    out = x.new_empty(x.shape[0], n // 2 if silu_mul else n)
    if x.shape[0]:
        _launch(x, weight, out, config, silu_mul, live, pdl)
    return out


def skinny_linear_partials(
    x: torch.Tensor, weight: torch.Tensor | Fp8Weight, config: SkinnyConfig, pdl: bool = False
) -> torch.Tensor:
    """x @ weight.T as config.split_k float32 partial sums over K slices ([split_k, rows, N]);
    their sum is the product. Graph-safe."""
    _check(x, weight)
    out = torch.empty(
        config.split_k, x.shape[0], weight.shape[0], device=x.device, dtype=torch.float32
    )
    if x.shape[0]:
        _launch(x, weight, out, config, False, None, pdl)
    return out
