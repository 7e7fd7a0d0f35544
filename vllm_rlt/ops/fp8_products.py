"""FP8 tensor-core products of the Triton backend (float8 rows by float8 weights): which
kernel runs one, a Triton W8A8 tile or cuBLAS, and what rides along with it (split-K
partial sums for the add + norms kernel, the MLP's SiLU-mul in the tile's epilogue)."""

from __future__ import annotations

import torch

from vllm_rlt.kernels.fp8_rows import Fp8Rows, fp8_rows_linear, quantize_rows
from vllm_rlt.kernels.w8a8_gemm import w8a8_gemm
from vllm_rlt.layers.fp8 import Fp8Weight
from vllm_rlt.ops.base import Weight
from vllm_rlt.ops.linear_plans import takes_fp8_rows, w8a8_plan

# Where a W8A8 tile runs the gate/up product, it does the SiLU-mul in its epilogue and a
# quantize kernel scales the result (half the product's width) for the down projection,
# instead of the float8 SiLU-mul kernel, which holds a whole row per program to take the
# row's scale (64 programs at 64 rows: 5.3 us a layer on an H100, against 2.2 for bf16).
W8A8_SILU_EPILOGUE = True


def fp8_product(
    x: Fp8Rows, weight: Fp8Weight, split_ok: bool = False, pdl: bool = False
) -> torch.Tensor:
    """x @ weight.T: the W8A8 tile linear_plans.py picks for the rows, else cuBLAS. With
    split_ok, [slices, rows, N] float32 partial sums (one slice: the [1, rows, N] product)
    for the add + norms kernel to sum."""
    tile = w8a8_plan(x.shape[0], weight, split_ok)
    out = fp8_rows_linear(x, weight) if tile is None else w8a8_gemm(x, weight, tile, pdl=pdl)
    return out.unsqueeze(0) if split_ok and out.dim() == 2 else out


def fp8_silu_mul_epilogue(
    x: Fp8Rows, gate_up: Fp8Weight, next_weight: Weight | None, pdl: bool = False
) -> torch.Tensor | Fp8Rows | None:
    """SiLU-mul(x @ gate_up.T) from a W8A8 tile's epilogue, as float8 rows where
    `next_weight`'s product takes them; None where no tile runs it (W8A8_SILU_EPILOGUE)."""
    tile = w8a8_plan(x.shape[0], gate_up) if W8A8_SILU_EPILOGUE else None
    if tile is None:
        return None
    act = w8a8_gemm(x, gate_up, tile, silu_mul=True, pdl=pdl)
    if takes_fp8_rows(act.shape[0], act.dtype, next_weight):
        return quantize_rows(act, pdl)
    return act
