"""Which kernel a linear layer runs on the Triton backend, and its launch shape: measured per
layer shape and row count, so that few-row (decode) passes stream each weight once and
many-row passes take cuBLAS."""

from __future__ import annotations

from dataclasses import replace

import torch

from vllm_rlt.kernels import few_row_gemm
from vllm_rlt.kernels.skinny_linear import SkinnyConfig
from vllm_rlt.kernels.strip_gemv import strip_rows
from vllm_rlt.kernels.w8a8_tile import W8A8Tile
from vllm_rlt.layers.fp8 import Fp8Weight
from vllm_rlt.ops.base import Weight
from vllm_rlt.ops.w8a8_tables import layer_class, w8a8_table

# Linear layers: per layer shape, the launch shape for passes of up to so many rows, in
# increasing order; a pass with more rows than the last entry runs cuBLAS. Chosen with
# benchmarks/tune_linear.py on an H200 in bf16 at Ouro-1.4B shapes (o 2048 x 2048, qkv
# 6144 x 2048, gate_up 11264 x 2048, LM head 49152 x 2048, down 2048 x 5632); block_k is
# in bf16 elements. Split-K (last field) is used only where the product feeds the residual
# add and norm, which sums the slices.
LINEAR_PLANS: dict[str, tuple[tuple[int, SkinnyConfig], ...]] = {
    "narrow": (  # N <= 4096, N >= K (o): 1.06-1.15x cuBLAS with the norm that follows
        (16, SkinnyConfig(32, 128, 4, 4, 16, 2)),
        (32, SkinnyConfig(32, 128, 4, 4, 32, 2)),
        (64, SkinnyConfig(32, 128, 4, 4, 64, 2)),
    ),
    "medium": ((16, SkinnyConfig(64, 256, 4, 4, 16)),),  # N <= 8192 (qkv): 0.89x at 32 rows
    "wide": (  # N <= 16384 (gate_up + SiLU-mul): 1.06-1.14x cuBLAS + SiLU-mul
        (16, SkinnyConfig(32, 128, 4, 4, 16)),
        (32, SkinnyConfig(32, 128, 4, 4, 32)),
        (64, SkinnyConfig(128, 128, 8, 4, 64)),
    ),
    "head": (  # wider (LM head): 1.05-1.09x
        (16, SkinnyConfig(64, 256, 4, 3, 16)),
        (32, SkinnyConfig(128, 128, 4, 3, 32)),
        (64, SkinnyConfig(128, 64, 8, 3, 64)),
    ),
    "deep": ((16, SkinnyConfig(32, 128, 4, 4, 16, 4)),),  # N < K (down): 0.96x at 32 rows
}
# The plans above 16 rows were measured at K = 2,048. A weight more than twice as deep keeps
# only the entries up to DEEP_SKINNY_ROWS and takes cuBLAS above: at 64 rows Huginn-3.5B's
# qkv and gate_up (K = 5,280) streamed 2.0 TB/s on the 128-column tiles on an H200
# (profile_pass, concurrency 64: a program per 128 columns walks 1.35 MB of weights alone),
# where cuBLAS ran its o and down projections at 3.3-3.8 TB/s. Products with a live mask
# (Huginn's prelude, coda and LM head) take LIVE_SKINNY above 16 rows instead.
TUNED_DEPTH, DEEP_SKINNY_ROWS = 4096, 16


# A product with a live mask (the LM head; Huginn's prelude and coda, whose rows are live
# only at a token's first or exit loop) keeps the skinny kernel up to this many rows in one
# row tile, even where its layer class takes cuBLAS, so that a pass with no live row streams
# none of the weight. Chosen by count, not yet timed: at 64 rows it spares Huginn-3.5B's
# attention output and down projections in the 31 of 32 loops where no row starts or exits.
LIVE_SKINNY_ROWS, LIVE_SKINNY = 64, SkinnyConfig(128, 128, 8, 4, 64)
# FP8 weights take the skinny kernel (widened in registers, with bf16's launch shapes) up to
# this many rows, and FP8 tensor cores with per-token activation scales (fp8_rows.py) above.
# With cuBLAS's FP8 products, 16 against 64 on an H200: 1.20x at concurrency 32, 1.12x at
# 64, equal at 8. The W8A8 tiles below stream the whole layer's weights at 32 rows in 30.6
# us on an H100, against the skinny kernel's 47.5 at 8 rows (probe_few_row_gemm), so from
# 2 rows on the products round their inputs per token as vLLM's FP8 does (the KL and
# accuracy of that rounding: docs/benchmarks/2026-12-04-split-kv-fp8-rows.md). One row
# keeps the weight-only products (strip_gemv).
FP8_SKINNY_ROWS = 1
# A product with a live mask over fp8 weights keeps the skinny kernel, which skips idle row
# tiles, up to this many rows (no model of the engine has such a product yet).
FP8_LIVE_SKINNY_ROWS = 16
# A product over fp8 weights that FP8 tensor cores do not take (float16 or float32
# activations; a weight dimension no multiple of 16) keeps the skinny kernel up to this many
# rows, as every fp8 product did before the W8A8 tiles, and the dequantizing product above.
FP8_UNSCALED_SKINNY_ROWS = 16

# Passes of at most so many rows run these layer classes (per weight dtype: bf16, float8)
# with each program's weight strip in registers, loaded before the wait on the previous
# kernel (kernels/strip_gemv.py), where a strip fits. On an H200 at one row, Ouro-1.4B
# shapes, against the skinny kernel (o: its split-K form), float8 qkv 4.9 / 10.9 us, o
# 2.6 / 4.5, gate_up 7.8 / 14.3 (benchmarks/probe_register_gemv.py), and in the engine at
# concurrency 1: 1.21x (169 -> 205 decode tok/s). bf16 gained 1.0-1.1x per projection in
# the probe but lost in the engine (0.97x), so it keeps the skinny kernel. At 8 rows float8
# lost (0.64x at concurrency 8: the CUDA-core products grow with the rows), and 4 rows lost
# under steady load (0.84x, --waves 4 at concurrency 4). Down (N < K) keeps the skinny
# kernel's split-K. 0: never.
STRIP_GEMV_ROWS = 1
STRIP_GEMV_CLASSES = {False: (), True: ("narrow", "medium", "wide")}


def linear_plan(
    x: torch.Tensor, weight: Weight, split_ok: bool = False, live: bool = False
) -> SkinnyConfig | None:
    """The skinny launch shape for x's rows, or None for cuBLAS. Without split_ok (the
    consumer needs the finished product), a split-K plan runs with one slice. Wider
    activations take proportionally shorter K chunks, so a tile holds the same registers.
    An fp8 weight's tile is widened to its activations' dtype and its K chunk doubles, so
    that a pipeline stage moves as many weight bytes as in bf16 (measured on an H200:
    1.06x at 8 rows). Products over fp8 weights that FP8 tensor cores do not take keep the
    skinny plans up to FP8_UNSCALED_SKINNY_ROWS. `live`: the product has a live mask (see
    LIVE_SKINNY_ROWS)."""
    n, k = weight.shape
    fp8 = isinstance(weight, Fp8Weight)
    if fp8 and x.shape[0] > (FP8_LIVE_SKINNY_ROWS if live else FP8_SKINNY_ROWS):
        if fp8_tensor_cores_take(x.dtype, weight) or x.shape[0] > FP8_UNSCALED_SKINNY_ROWS:
            return None  # FP8 tensor cores, or the dequantizing product
    plans = LINEAR_PLANS[layer_class(n, k)]
    if k > TUNED_DEPTH:
        plans = tuple(entry for entry in plans if entry[0] <= DEEP_SKINNY_ROWS)
    if live and not fp8:
        plans += ((LIVE_SKINNY_ROWS, LIVE_SKINNY),)
    for most_rows, config in plans:
        if x.shape[0] <= most_rows:
            wide = 2 if fp8 else 1
            return replace(
                config,
                block_k=config.block_k * 2 * wide // x.element_size(),
                split_k=config.split_k if split_ok else 1,
            )
    return None


def w8a8_plan(rows: int, weight: Fp8Weight, split_ok: bool = False) -> W8A8Tile | None:
    """The Triton W8A8 tile for an FP8 tensor-core product of `rows` float8 rows by
    `weight`, or None for cuBLAS (see ops/w8a8_tables.py); without split_ok, one K slice
    unless the tile sums its slices itself (`reduce`)."""
    if not weight.data.is_contiguous():
        return None
    for most_rows, tile in w8a8_table(weight.data.device).get(layer_class(*weight.shape), ()):
        if rows <= most_rows:
            if tile is None or split_ok or tile.reduce:
                return tile
            return replace(tile, split_k=1)
    return None


def takes_strip(x: torch.Tensor, weight: Weight) -> bool:
    """Whether x @ weight.T runs strip_gemv (see STRIP_GEMV_ROWS)."""
    classes = STRIP_GEMV_CLASSES[isinstance(weight, Fp8Weight)]
    return (
        x.shape[0] <= STRIP_GEMV_ROWS
        and layer_class(*weight.shape) in classes
        and strip_rows(weight) > 0
    )


def takes_fp8_rows(rows: int, dtype: torch.dtype, weight: Weight | None) -> bool:
    """Whether a product of `rows` rows of `dtype` activations by `weight` runs on FP8
    tensor cores with per-token scales (kernels/fp8_rows.py) in every TritonOps path, so
    that the kernel before it may hand it float8 rows (`Fp8Rows`): not where the few-row
    CUDA kernels are set to take float8 weights (FP8_CUDA_ROWS)."""
    fewest = max(FP8_SKINNY_ROWS, few_row_gemm.FP8_CUDA_ROWS)
    return rows > fewest and fp8_tensor_cores_take(dtype, weight)


def fp8_tensor_cores_take(dtype: torch.dtype, weight: Weight | None) -> bool:
    """Whether cuBLAS's rowwise-scaled FP8 product takes `dtype` activations by `weight`:
    a float8 weight with both dimensions multiples of 16, bf16 activations (the only
    output dtype it gives that product in)."""
    return (
        isinstance(weight, Fp8Weight)
        and dtype == torch.bfloat16
        and all(d % 16 == 0 for d in weight.shape)
    )
