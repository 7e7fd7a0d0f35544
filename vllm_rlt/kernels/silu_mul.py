"""SiLU(gate) * up over the interleaved gate/up columns of the MLP.

Rounding follows the torch reference step by step (each bf16 product and sum is rounded
where torch rounds it), so the Triton and torch backends differ only by reduction order.
"""

from __future__ import annotations

import triton
import triton.language as tl

from vllm_rlt.kernels.fp8_rows import store_row
from vllm_rlt.kernels.pdl import pdl_enter


@triton.jit
def silu_times(gate, up, dtype: tl.constexpr):
    """SiLU(gate) * up in `dtype`, from float32 gate and up already rounded to `dtype`,
    rounded where torch rounds (the activation, then the product): every kernel that does
    the MLP's SiLU-mul uses it."""
    return ((gate * tl.sigmoid(gate)).to(dtype).to(tl.float32) * up).to(dtype)


@triton.jit
def silu_times_pairs(y, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, dtype: tl.constexpr):
    """silu_times over a [BLOCK_M, BLOCK_N] float32 product tile whose columns interleave
    gate and up (gate_0, up_0, gate_1, ...): [BLOCK_M, BLOCK_N // 2] in `dtype`."""
    gate, up = tl.split(tl.reshape(y.to(dtype).to(tl.float32), (BLOCK_M, BLOCK_N // 2, 2)))
    return silu_times(gate, up, dtype)


@triton.jit
def _silu_mul_kernel(
    gu_ptr,
    out_ptr,
    scale_ptr,
    gu_stride,
    inter,
    BLOCK: tl.constexpr,
    FP8_OUT: tl.constexpr,
    FP8_RANGE: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """A block of one row's SiLU(gate) * up; with FP8_OUT (one program holds the whole
    row) it leaves in float8 with its per-token scale (the FP8 down projection's input)."""
    pdl_enter(USE_PDL)
    row = tl.program_id(0).to(tl.int64)  # row * stride passes 2**31 in large passes
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    dtype = gu_ptr.dtype.element_ty
    pair = gu_ptr + row * gu_stride + 2 * cols  # interleaved gate_j, up_j
    gate = tl.load(pair, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(pair + 1, mask=mask, other=0.0).to(tl.float32)
    out = silu_times(gate, up, dtype)
    store_row(out_ptr + row * inter + cols, scale_ptr + row, out, mask, FP8_OUT, FP8_RANGE)
