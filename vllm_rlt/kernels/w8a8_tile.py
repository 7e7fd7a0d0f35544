"""The launch shape of a W8A8 tile (kernels/w8a8_gemm.py), apart from the kernel so that
the per-GPU tables of shapes (ops/w8a8_tables.py) load and are tested without Triton."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class W8A8Tile:
    """Launch shape: output rows and columns per program, the K chunk (float8 elements),
    the number of K slices, warps, pipeline stages, whether each K chunk's product is
    promoted into a float32 sum, and whether the K slices are summed in the kernel (the
    finished product) rather than handed on as partial sums (kernels/w8a8_gemm.py)."""

    block_m: int = 64
    block_n: int = 64
    block_k: int = 128
    split_k: int = 1
    warps: int = 4
    stages: int = 4
    promote: bool = False
    reduce: bool = False
