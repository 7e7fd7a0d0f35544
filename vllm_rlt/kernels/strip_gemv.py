"""Linear layers for a handful of rows, with each program's weight strip held in registers.

At one to a few rows a decode pass is a chain of dependent GEMVs, each a few microseconds
of weight traffic. The skinny kernel (skinny_linear.py) pads the rows to a 16-row tl.dot
tile staged through shared memory, and every program starts reading its weights only after
its predecessor has finished. Here a program loads its whole strip of BLOCK_N weight rows
(all of K) into registers *before* the programmatic-dependent wait, so the weight traffic
overlaps the previous kernel's tail, then multiplies each activation row with the strip on
CUDA cores (float32 products and sums). Float8 weights are widened to float32 once per
program, not once per row, and scaled per output column.

Only strips that fit: K a power of two (the strip is one register tile) and at most
STRIP_ELEMENTS a program. The gate/up projection's SiLU-and-multiply rides along as in the
skinny kernel (interleaved gate, up columns, so a strip holds matching pairs).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm_rlt.kernels.pdl import launch_options, pdl_enter
from vllm_rlt.layers.fp8 import Fp8Weight

# Weight elements a program holds: 8 rows of K = 2,048 fill 128 registers a thread at 4
# warps once widened to float32 (a benchmarks/probe_register_gemv.py shape measured on an
# H200 at one row, in bf16 and float8).
STRIP_ELEMENTS = 16384
STRIP_WARPS = 4


@triton.jit
def _strip_gemv_kernel(
    x_ptr,
    w_ptr,
    scale_ptr,
    out_ptr,
    M,
    N,
    x_stride,
    out_stride,
    K: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SILU_MUL: tl.constexpr,
    W_SCALED: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """out[m, n] = sum_k x[m, k] * w[n, k] for the first M of ROWS rows, or with SILU_MUL
    out[m, j] = silu(y[m, 2j]) * y[m, 2j + 1] rounded like the unfused torch ops. The strip
    loads before the wait on the predecessor, which writes x."""
    pid = tl.program_id(0)
    cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    ks = tl.arange(0, K)
    w = tl.load(w_ptr + cols[:, None] * K + ks[None, :], mask=col_ok[:, None], other=0.0)
    if W_SCALED:
        scale = tl.load(scale_ptr + cols, mask=col_ok, other=0.0)
    pdl_enter(USE_PDL)
    w = w.to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    for r in tl.static_range(ROWS):
        row_ok = r < M
        x = tl.load(x_ptr + r * x_stride + ks, mask=(ks < K) & row_ok, other=0.0)
        y = tl.sum(w * x.to(tl.float32)[None, :], axis=1)
        if W_SCALED:
            y = y * scale
        if SILU_MUL:
            y = y.to(dtype).to(tl.float32)
            gate, up = tl.split(tl.reshape(y, (BLOCK_N // 2, 2)))
            out = ((gate * tl.sigmoid(gate)).to(dtype).to(tl.float32) * up).to(dtype)
            half = pid * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
            tl.store(out_ptr + r * out_stride + half, out, mask=(half < N // 2) & row_ok)
        else:
            tl.store(out_ptr + r * out_stride + cols, y.to(dtype), mask=col_ok & row_ok)


def strip_rows(weight: torch.Tensor | Fp8Weight) -> int:
    """Weight rows a program holds (a power of two, at least 2), or 0 if no strip fits."""
    k = weight.shape[1]
    if k & (k - 1):
        return 0
    rows = STRIP_ELEMENTS // k
    return 1 << (rows.bit_length() - 1) if rows >= 2 else 0


def strip_gemv(
    x: torch.Tensor,  # [rows, K], few rows
    weight: torch.Tensor | Fp8Weight,  # [N, K], contiguous; with silu_mul rows interleave gate, up
    silu_mul: bool = False,
    pdl: bool = False,  # launch as a programmatic dependent (see kernels/pdl.py)
) -> torch.Tensor:
    """x @ weight.T ([rows, N]), or its SiLU-mul ([rows, N / 2]); graph-safe."""
    data, scale = weight.tensors() if isinstance(weight, Fp8Weight) else (weight, None)
    n, k = data.shape
    block_n = strip_rows(weight)
    if not block_n:
        raise ValueError(f"strip_gemv: no strip of K={k} fits {STRIP_ELEMENTS} elements")
    if x.shape[1] != k or x.stride(-1) != 1 or data.stride(0) != k or data.stride(1) != 1:
        raise ValueError("strip_gemv needs row-major x with K columns and a contiguous weight")
    if silu_mul and n % 2:
        raise ValueError(f"strip_gemv: silu_mul needs an even N, got {n}")
    rows = x.shape[0]
    out = x.new_empty(rows, n // 2 if silu_mul else n)
    if rows:
        _strip_gemv_kernel[(triton.cdiv(n, block_n),)](
            x,
            data,
            x if scale is None else scale,
            out,
            rows,
            n,
            x.stride(0),
            out.stride(0),
            K=k,
            ROWS=triton.next_power_of_2(rows),
            BLOCK_N=block_n,
            SILU_MUL=silu_mul,
            W_SCALED=scale is not None,
            num_warps=STRIP_WARPS,
            **launch_options(pdl),
        )
    return out
