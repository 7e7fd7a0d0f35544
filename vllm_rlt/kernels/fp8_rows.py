"""FP8 tensor cores for passes of many rows under fp8 weights: every row of the activations
is scaled into the float8 range by its own largest magnitude (a per-token scale) in one
kernel that reads the row once, and cuBLAS multiplies with both scales applied to its
float32 accumulator. In torch the scaling took six kernels per projection, which cost more
than the float8 weights saved (docs/benchmarks/2026-12-04-fp8.md)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm_rlt.kernels.pdl import launch_options, pdl_enter
from vllm_rlt.layers.fp8 import FP8_DTYPE, FP8_MAX, Fp8Weight


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
    """out[row] = x[row] / scale[row] in float8, scale[row] = max |x[row]| / FP8_RANGE
    (at least 1e-30, a normal float32: an all-zero row, such as a padding row, gives zeros,
    never 0 / 0)."""
    pdl_enter(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(x), axis=0) / FP8_RANGE, 1e-30)
    tl.store(scale_ptr + row, scale)
    tl.store(out_ptr + row * n + cols, (x / scale).to(out_ptr.dtype.element_ty), mask=mask)


def fp8_linear_rows(x: torch.Tensor, weight: Fp8Weight, pdl: bool = False) -> torch.Tensor:
    """x @ W.T ([rows, N], x's dtype: bf16) on FP8 tensor cores; graph-safe."""
    rows, k = x.shape
    n = weight.shape[0]
    if not rows:
        return x.new_empty(0, n)
    if x.stride(-1) != 1:
        x = x.contiguous()
    x_fp8 = torch.empty(rows, k, dtype=FP8_DTYPE, device=x.device)
    x_scale = torch.empty(rows, 1, dtype=torch.float32, device=x.device)
    block = triton.next_power_of_2(k)
    _quantize_rows_kernel[(rows,)](
        x,
        x_fp8,
        x_scale,
        x.stride(0),
        k,
        FP8_RANGE=FP8_MAX,
        BLOCK=block,
        num_warps=8 if block >= 4096 else 4,
        **launch_options(pdl),
    )
    return torch._scaled_mm(
        x_fp8, weight.data.t(), scale_a=x_scale, scale_b=weight.scale[None, :], out_dtype=x.dtype
    )
