"""Few-row products on the tensor cores, bf16 or FP8 weights (csrc/few_row_gemm.cu).

For 1 to 16 rows of bf16 activations the weight tile is the 16-row mma.sync operand and
the activation rows the narrow one, so the weights stream once at the rows' cost of a
padded 8- or 16-column tile, where the CUDA-core GEMVs (strip_gemv.py) grow with the rows
and the skinny Triton kernel pads the rows to its tile (and widens float8 weights per
program). Float8 weights are widened to bf16 in registers. Weight loads start before the
wait on the previous kernel (programmatic dependent launch). `few_row_gemm_add_norms` ends
with a sandwich layer's residual add and norms, done by the last block to finish (a
counter, not a kernel of their own). Built on first use (cuda_build.py); without it the
Triton kernels serve.
"""

from __future__ import annotations

import ctypes

import torch

from vllm_rlt.kernels.counter_ring import CounterRing
from vllm_rlt.kernels.cuda_build import cuda_module
from vllm_rlt.kernels.cuda_driver import CudaModule
from vllm_rlt.layers.fp8 import Fp8Weight

# Passes of at most so many rows take the kernel, per weight dtype (at most 16; 0: never).
# Off until measured against the Triton paths on a GPU (benchmarks/probe_few_row_gemm.py,
# then a same-run engine A/B of these constants).
FP8_CUDA_ROWS = 0
BF16_CUDA_ROWS = 0


# The add-norms kernels' counters, one a launch (the last block resets its own).
COUNTERS = CounterRing("few_row_gemm_add_norms", per_launch=1, launches=4096)


def _module(device: torch.device) -> CudaModule | None:
    index = device.index if device.index is not None else torch.cuda.current_device()
    return cuda_module("few_row_gemm", index, min_capability=(8, 0))  # bf16 mma.sync


def takes_few_row(x: torch.Tensor, weight: torch.Tensor | Fp8Weight) -> bool:
    """Whether the engine's x @ weight.T runs the kernel: at most FP8_CUDA_ROWS (float8
    weights) or BF16_CUDA_ROWS (bf16) rows that it fits."""
    limit = FP8_CUDA_ROWS if isinstance(weight, Fp8Weight) else BF16_CUDA_ROWS
    return x.shape[0] <= limit and fits_few_row(x, weight)


def fits_few_row(x: torch.Tensor, weight: torch.Tensor | Fp8Weight) -> bool:
    """Whether the kernel can compute x @ weight.T: float8 or bf16 weights whose rows are
    whole and contiguous, N a multiple of 16 and K of 64, 1..16 bf16 rows aligned to 16
    bytes, on a device the kernel was built for."""
    if not 1 <= x.shape[0] <= 16:
        return False
    if isinstance(weight, Fp8Weight):
        data, scale = weight.tensors()
        if not scale.is_contiguous():
            return False
    elif isinstance(weight, torch.Tensor) and weight.dtype == torch.bfloat16:
        data = weight
    else:
        return False
    n, k = data.shape
    return (
        x.dtype == torch.bfloat16
        and x.is_cuda
        and n % 16 == 0
        and k % 64 == 0
        and x.shape[1] == k
        and x.stride(1) == 1
        and x.stride(0) % 8 == 0
        and x.data_ptr() % 16 == 0
        and data.stride() == (k, 1)
        and data.data_ptr() % 16 == 0
        and _module(x.device) is not None
    )


def _out_features(weight: torch.Tensor | Fp8Weight) -> int:
    return (weight.tensors()[0] if isinstance(weight, Fp8Weight) else weight).shape[0]


def _launch(x: torch.Tensor, weight: torch.Tensor | Fp8Weight, kind: str, tail: tuple, pdl: bool):
    """Launch the kernel `kind` ("", "_silu", ...) of x's row count and weight's dtype on
    (x, its row stride, the weight, its scales, *tail)."""
    fp8 = isinstance(weight, Fp8Weight)
    data, scale = weight.tensors() if fp8 else (weight, weight)  # bf16: scale unread
    rows, n = x.shape[0], data.shape[0]
    name = ("w8a16" if fp8 else "w16a16") + ("_n8" if rows <= 8 else "_n16") + kind
    kernel = _module(x.device).kernel(name)
    args = (ctypes.c_void_p(x.data_ptr()), ctypes.c_int(x.stride(0)))
    args += (ctypes.c_void_p(data.data_ptr()), ctypes.c_void_p(scale.data_ptr()), *tail)
    stream = torch.cuda.current_stream(x.device).cuda_stream
    kernel.launch(n // 16, kernel.max_threads, stream, args, pdl=pdl)


def few_row_gemm(
    x: torch.Tensor,  # [rows, K] bf16, 1..16 rows (see fits_few_row)
    weight: torch.Tensor | Fp8Weight,  # [N, K]; with silu_mul rows interleave gate, up
    silu_mul: bool = False,
    pdl: bool = False,  # launched as a programmatic dependent (see kernels/pdl.py)
) -> torch.Tensor:
    """x @ weight.T ([rows, N]), or its SiLU-mul ([rows, N / 2]); graph-safe."""
    rows, n = x.shape[0], _out_features(weight)
    out = x.new_empty(rows, n // 2 if silu_mul else n)  # [rows, N or N / 2]
    pointer, integer = ctypes.c_void_p, ctypes.c_int
    tail = (pointer(out.data_ptr()), integer(out.stride(0)), integer(rows))
    tail += (integer(x.shape[1]), integer(int(pdl)))
    _launch(x, weight, "_silu" if silu_mul else "", tail, pdl)
    return out


def few_row_gemm_add_norms(
    residual: torch.Tensor,  # [rows, N] bf16
    x: torch.Tensor,  # [rows, K] bf16, 1..16 rows (see fits_few_row)
    weight: torch.Tensor | Fp8Weight,  # [N, K]
    w_branch: torch.Tensor | None,  # [N] the branch's norm (None: the branch as it is)
    w_next: torch.Tensor,  # [N] the next norm
    eps: float,
    pdl: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(residual + w_branch * norm(x @ weight.T), w_next * norm of that), each [rows, N]
    bf16, as TritonOps.add_rms_norm2 of the product; graph-safe."""
    rows, n = x.shape[0], _out_features(weight)
    norm = w_next if w_branch is None else w_branch  # unread without a branch norm
    assert residual.shape == (rows, n) and residual.stride(1) == 1
    assert w_next.is_contiguous() and norm.is_contiguous()
    assert residual.dtype == w_next.dtype == norm.dtype == torch.bfloat16
    # A warp a row, the row in registers: 16-byte vectors of at most 2,048 values.
    aligned = (t.data_ptr() % 16 == 0 for t in (residual, norm, w_next))
    vectorized = n % 8 == 0 and n <= 2048 and residual.stride(0) % 8 == 0 and all(aligned)
    branch = x.new_empty(rows, n)  # the product, read back by the last block
    x_out, normed = x.new_empty(rows, n), x.new_empty(rows, n)
    pointer, integer = ctypes.c_void_p, ctypes.c_int
    tail = (pointer(branch.data_ptr()), integer(rows), integer(x.shape[1]))
    tail += (pointer(residual.data_ptr()), integer(residual.stride(0)), pointer(norm.data_ptr()))
    tail += (pointer(w_next.data_ptr()), pointer(x_out.data_ptr()), pointer(normed.data_ptr()))
    tail += (
        ctypes.c_float(eps),
        pointer(COUNTERS.next_address(x.device)),
        integer(int(vectorized)),
    )
    tail += (integer(int(pdl)),)
    kind = "_norm_add_norm" if w_branch is not None else "_add_norm"
    _launch(x, weight, kind, tail, pdl)
    return x_out, normed
