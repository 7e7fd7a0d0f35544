"""Few-row products with FP8 weights on the tensor cores (csrc/w8a16_gemm.cu).

From 1 to W8A16_ROWS rows of bf16 activations, each float8 weight is widened to bf16 in
registers and multiplied with mma.sync, the weight tile as the 16-row operand and the
activation rows as the narrow one: the weights stream once at the rows' cost of a padded
8- or 16-column tile, where the CUDA-core GEMVs (strip_gemv.py) grow with the rows and
the skinny Triton kernel pads the rows to its tile and widens the weights per program.
Weight loads start before the wait on the previous kernel (programmatic dependent
launch). Built on first use (cuda_build.py); without it the Triton kernels serve.
"""

from __future__ import annotations

import ctypes

import torch

from vllm_rlt.kernels.cuda_build import cuda_module
from vllm_rlt.kernels.cuda_driver import CudaModule
from vllm_rlt.layers.fp8 import Fp8Weight

# Passes of at most so many rows take the kernel (at most 16; 0: never). Off until it is
# measured against the Triton paths on a GPU (benchmarks/probe_w8a16.py, then a same-run
# engine A/B of this constant).
W8A16_ROWS = 0


def _module(device: torch.device) -> CudaModule | None:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if torch.cuda.get_device_capability(index) < (8, 0):  # bf16 mma.sync
        return None
    return cuda_module("w8a16_gemm", index)


def takes_w8a16(x: torch.Tensor, weight: torch.Tensor | Fp8Weight) -> bool:
    """Whether the engine's x @ weight.T runs the kernel: at most W8A16_ROWS rows that
    it fits."""
    return x.shape[0] <= W8A16_ROWS and fits_w8a16(x, weight)


def fits_w8a16(x: torch.Tensor, weight: torch.Tensor | Fp8Weight) -> bool:
    """Whether the kernel can compute x @ weight.T: float8 weights whose rows are whole and
    contiguous, N a multiple of 16 and K of 64, 1..16 bf16 rows aligned to 16 bytes, on a
    device the kernel was built for."""
    if not isinstance(weight, Fp8Weight) or not 1 <= x.shape[0] <= 16:
        return False
    data, scale = weight.tensors()
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
        and scale.is_contiguous()
        and _module(x.device) is not None
    )


def w8a16_gemm(
    x: torch.Tensor,  # [rows, K] bf16, 1..16 rows (see fits_w8a16)
    weight: Fp8Weight,  # [N, K]; with silu_mul rows interleave gate, up
    silu_mul: bool = False,
    pdl: bool = False,  # launched as a programmatic dependent (see kernels/pdl.py)
) -> torch.Tensor:
    """x @ weight.T ([rows, N]), or its SiLU-mul ([rows, N / 2]); graph-safe."""
    data, scale = weight.tensors()
    rows, (n, k) = x.shape[0], data.shape
    out = x.new_empty(rows, n // 2 if silu_mul else n)  # [rows, N or N / 2]
    name = ("w8a16_n8" if rows <= 8 else "w8a16_n16") + ("_silu" if silu_mul else "")
    kernel = _module(x.device).kernel(name)
    pointer, integer = ctypes.c_void_p, ctypes.c_int
    args = (pointer(x.data_ptr()), integer(x.stride(0)), pointer(data.data_ptr()))
    args += (pointer(scale.data_ptr()), pointer(out.data_ptr()), integer(out.stride(0)))
    args += (integer(rows), integer(k), integer(int(pdl)))
    stream = torch.cuda.current_stream(x.device).cuda_stream
    kernel.launch(n // 16, kernel.max_threads, stream, args, pdl=pdl)
    return out
