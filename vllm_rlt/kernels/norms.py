"""Fused RMSNorm kernels: one norm, and the residual add between two norms.

Rounding follows the torch reference step by step (each bf16 product and sum is rounded
where torch rounds it), so the Triton and torch backends differ only by reduction order.
With FP8_OUT the normed row, rounded to the activations' dtype as always, leaves already
scaled into float8 with its per-token scale (kernels/fp8_rows.py's quantize in the norm's
epilogue): the FP8 product that follows reads it without a quantize kernel of its own.
"""

from __future__ import annotations

import triton
import triton.language as tl

from vllm_rlt.kernels.fp8_rows import store_row
from vllm_rlt.kernels.pdl import pdl_enter


def row_warps(block: int) -> int:
    """Warps for a program that holds a whole row of `block` columns: 4 up to 2,048 (a
    thread keeps at most 16 of each of the row's vectors in registers), then one warp per
    512 columns up to 16. With 4 warps, the add + norms kernel on Huginn's 5,280-wide rows
    (8,192 columns) used 255 registers a thread (ptxas, sm_90; 100 with 16 warps) and took
    18 us at 8 rows on an H200, each row's loads issued by 128 threads."""
    return max(4, min(16, block // 512))


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    scale_ptr,
    x_stride,
    out_stride,
    n,
    eps,
    BLOCK: tl.constexpr,
    FP8_OUT: tl.constexpr,
    FP8_RANGE: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_enter(USE_PDL)
    row = tl.program_id(0).to(tl.int64)  # row * stride passes 2**31 in large passes
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    dtype = x_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n + eps)
    normed = (x * rstd).to(dtype).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    out = (w * normed).to(dtype)
    store_row(out_ptr + row * out_stride + cols, scale_ptr + row, out, mask, FP8_OUT, FP8_RANGE)


@triton.jit
def _add_rms_norm2_kernel(
    x_ptr,
    y_ptr,
    w1_ptr,
    w2_ptr,
    x_out_ptr,
    n_out_ptr,
    x_stride,
    y_stride,
    y_part_stride,
    scale_ptr,
    n,
    eps,
    BLOCK: tl.constexpr,
    PARTS: tl.constexpr,
    NORM_BRANCH: tl.constexpr,
    FP8_OUT: tl.constexpr,
    FP8_RANGE: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """x_out = x + w1 * norm(y) (x + y without NORM_BRANCH); n_out = w2 * norm(x_out)
    (in float8 with its scale under FP8_OUT). y is the sum of PARTS float32 partial
    products (split-K), added in order and rounded once like a GEMM's output, or with
    PARTS = 1 the finished branch."""
    pdl_enter(USE_PDL)
    row = tl.program_id(0).to(tl.int64)  # row * stride passes 2**31 in large passes
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    dtype = x_out_ptr.dtype.element_ty
    y = tl.zeros((BLOCK,), tl.float32)
    for part in tl.static_range(PARTS):
        y_offsets = part * y_part_stride + row * y_stride + cols
        y += tl.load(y_ptr + y_offsets, mask=mask, other=0.0).to(tl.float32)
    y = y.to(dtype).to(tl.float32)
    if NORM_BRANCH:
        y_rstd = 1.0 / tl.sqrt(tl.sum(y * y, axis=0) / n + eps)
        w1 = tl.load(w1_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        branch = (w1 * (y * y_rstd).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    else:
        branch = y
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    x = (x + branch).to(dtype)
    tl.store(x_out_ptr + row * n + cols, x, mask=mask)
    x32 = x.to(tl.float32)
    x_rstd = 1.0 / tl.sqrt(tl.sum(x32 * x32, axis=0) / n + eps)
    w2 = tl.load(w2_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    normed = (w2 * (x32 * x_rstd).to(dtype).to(tl.float32)).to(dtype)
    store_row(n_out_ptr + row * n + cols, scale_ptr + row, normed, mask, FP8_OUT, FP8_RANGE)
