"""FP8 tensor cores for passes of many rows under fp8 weights: every row of the activations
is scaled into the float8 range by its own largest magnitude (a per-token scale) in one
kernel that reads the row once, and cuBLAS or the W8A8 kernel of w8a8_gemm.py multiplies
with both scales applied to its float32 accumulator. In torch the scaling took six kernels
per projection, which cost more than the float8 weights saved
(docs/benchmarks/2026-12-04-fp8.md). Where a norm or the SiLU-mul feeds the product, its
kernel does the scaling in its epilogue (`store_row`) and hands on `Fp8Rows`, so no
quantize kernel runs."""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from vllm_rlt.kernels.pdl import launch_options, pdl_enter
from vllm_rlt.layers.fp8 import FP8_DTYPE, FP8_MAX, Fp8Weight


@triton.jit
def store_row(out_ptrs, scale_ptr, x, mask, FP8_OUT: tl.constexpr, FP8_RANGE: tl.constexpr):
    """Store one row `x` (in the activations' dtype) as it is, or with FP8_OUT scaled into
    float8 by its largest magnitude (at least 1e-30, a normal float32: an all-zero row, such
    as a padding row, gives zeros, never 0 / 0), its scale at scale_ptr."""
    if FP8_OUT:
        x32 = tl.where(mask, x.to(tl.float32), 0.0)
        scale = tl.maximum(tl.max(tl.abs(x32), axis=0) / FP8_RANGE, 1e-30)
        tl.store(scale_ptr, scale)
        tl.store(out_ptrs, (x32 / scale).to(out_ptrs.dtype.element_ty), mask=mask)
    else:
        tl.store(out_ptrs, x, mask=mask)


@triton.jit
def _quantize_rows_kernel(
    x_ptr,
    out_ptr,
    scale_ptr,
    x_stride,
    n,
    FP8_RANGE: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """out[row] = x[row] / scale[row] in float8, scale[row] = max |x[row]| / FP8_RANGE."""
    pdl_enter(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0)
    store_row(out_ptr + row * n + cols, scale_ptr + row, x, mask, True, FP8_RANGE)


@dataclasses.dataclass(frozen=True)
class Fp8Rows:
    """Activations already scaled into float8 for an FP8 product: what a norm or SiLU-mul
    kernel hands on in place of its [rows, K] output when the next product runs here."""

    data: torch.Tensor  # [rows, K] float8
    scale: torch.Tensor  # [rows, 1] float32
    dtype: torch.dtype  # the activations' dtype: the product's output dtype

    @property
    def shape(self) -> torch.Size:
        return self.data.shape


def empty_fp8_rows(rows: int, k: int, dtype: torch.dtype, device: torch.device) -> Fp8Rows:
    return Fp8Rows(
        torch.empty(rows, k, dtype=FP8_DTYPE, device=device),
        torch.empty(rows, 1, dtype=torch.float32, device=device),
        dtype,
    )


def quantize_rows(x: torch.Tensor, pdl: bool = False) -> Fp8Rows:
    """x ([rows, K], bf16) scaled into float8 row by row; graph-safe."""
    rows, k = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = empty_fp8_rows(rows, k, x.dtype, x.device)
    if rows:
        block = triton.next_power_of_2(k)
        _quantize_rows_kernel[(rows,)](
            x,
            out.data,
            out.scale,
            x.stride(0),
            k,
            FP8_RANGE=FP8_MAX,
            BLOCK=block,
            num_warps=8 if block >= 4096 else 4,
            **launch_options(pdl),
        )
    return out


def fp8_rows_linear(x: Fp8Rows, weight: Fp8Weight) -> torch.Tensor:
    """x @ W.T ([rows, N], x.dtype) on FP8 tensor cores, both scales applied to cuBLAS's
    float32 accumulator."""
    if not x.shape[0]:
        return torch.empty(0, weight.shape[0], dtype=x.dtype, device=x.data.device)
    return torch._scaled_mm(
        x.data, weight.data.t(), scale_a=x.scale, scale_b=weight.scale[None, :], out_dtype=x.dtype
    )
