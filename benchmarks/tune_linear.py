"""Time the skinny linear kernel over launch shapes against cuBLAS, at Ouro-1.4B layer shapes
(and on request Huginn-3.5B's widest, K = 5,280), to choose the rows of LINEAR_PLANS
(vllm_rlt/ops/linear_plans.py).

Each case runs back to back in a CUDA graph over enough weight copies to defeat the L2 cache,
as the layers of a real pass do. Layers that feed the residual add and norm (o, down) are
timed together with that norm kernel, which is where split-K slices are summed; their cuBLAS
figure is cuBLAS plus the same norm. Every launch shape is compiled first in parallel worker
processes (Triton's on-disk cache keeps the binaries), then timed one at a time.

With --fp8 the weights are float8 with per-row scales, the skinny kernel
widens them in registers, and the baseline is the path fp8 weights take without a skinny
plan: per-token activation scales and FP8 tensor cores (kernels/fp8_rows.py).

python -m benchmarks.tune_linear [--rows 1 16 32 64] [--shapes o down] [--jobs 8] [--fp8]
python -m benchmarks.tune_linear --rows 16 32 64 --shapes huginn_qkv huginn_fc
"""

from __future__ import annotations

import itertools
import multiprocessing

import torch

import benchmarks.needs_triton  # noqa: F401 (first: says what is missing)
from benchmarks.graph_timing import graph_time_us
from vllm_rlt.cli_parser import CLIParser
from vllm_rlt.kernels.skinny_linear import SkinnyConfig, skinny_linear, skinny_linear_partials
from vllm_rlt.layers.fp8 import Fp8Weight
from vllm_rlt.ops.triton_ops import TritonOps, _dense_linear

# name: (N, K, SiLU-mul epilogue, feeds the residual add and norm)
SHAPES = {
    "qkv": (6144, 2048, False, False),
    "o": (2048, 2048, False, True),
    "gate_up": (11264, 2048, True, False),
    "down": (2048, 5632, False, True),
    "lm_head": (49152, 2048, False, False),
}
OURO_SHAPES = list(SHAPES)
SHAPES |= {"huginn_qkv": (15840, 5280, False, False), "huginn_fc": (35840, 5280, False, False)}
L2_DEFEAT_BYTES = 160 * 2**20


def tile_rows(rows: int) -> int:
    return 16 if rows <= 16 else 32 if rows <= 32 else 64


def candidates(name: str, rows: int, fp8: bool = False) -> list[SkinnyConfig]:
    """Launch shapes worth timing for this layer and row count (float8 weights: K chunks
    twice as long, so a stage moves as many bytes)."""
    block_m = tile_rows(rows)
    feeds_norm = SHAPES[name][3]
    wide = 2 if fp8 else 1
    if block_m == 16:
        chunks = (128 * wide, 256 * wide)
        grid = itertools.product((16, 32, 64), chunks, (4,), (3, 4), (1, 2, 4))
    else:
        chunks = (64 * wide, 128 * wide)
        grid = itertools.product((32, 64, 128), chunks, (4, 8), (3, 4), (1, 2))
    return [
        SkinnyConfig(block_n, block_k, warps, stages, block_m, split)
        for block_n, block_k, warps, stages, split in grid
        if split == 1 or feeds_norm
    ]


def case(name: str, rows: int, copies: int, fp8: bool = False):
    """Inputs, weights and the two callables (dense path, skinny path) of one case: the
    dense path is cuBLAS, or for fp8 weights per-token scales and FP8 tensor cores."""
    n, k, silu, feeds_norm = SHAPES[name]
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
    if fp8:
        weights = [Fp8Weight.quantize(w) for w in weights]
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    ops = TritonOps()
    if feeds_norm:
        h = torch.randn(rows, n, device="cuda", dtype=torch.bfloat16)
        w1 = torch.ones(n, device="cuda", dtype=torch.bfloat16)

        def cublas(i):
            return ops.add_rms_norm2(h, _dense_linear(x, weights[i]), w1, w1, 1e-6)

        def skinny(i, c):
            if c.split_k == 1:
                return ops.add_rms_norm2(h, skinny_linear(x, weights[i], c), w1, w1, 1e-6)
            return ops._add_rms_norm2(h, skinny_linear_partials(x, weights[i], c), w1, w1, 1e-6)

    elif silu:  # what the skinny epilogue replaces: cuBLAS, then the SiLU-mul kernel

        def cublas(i):
            return ops.silu_mul(_dense_linear(x, weights[i]))

        def skinny(i, c):
            return skinny_linear(x, weights[i], c, silu_mul=True)

    else:

        def cublas(i):
            return _dense_linear(x, weights[i])

        def skinny(i, c):
            return skinny_linear(x, weights[i], c)

    return cublas, skinny


def compile_all(job: tuple[str, int, bool]) -> int:
    """Worker: run every candidate once so Triton compiles and caches it."""
    name, rows, fp8 = job
    _, skinny = case(name, rows, 1, fp8)
    for config in candidates(name, rows, fp8):
        try:
            skinny(0, config)
        except Exception:  # shapes that exceed shared memory or registers
            pass
    torch.cuda.synchronize()
    return rows


def tune(name: str, rows: list[int], fp8: bool = False) -> None:
    n, k = SHAPES[name][:2]
    nbytes = n * k * (1 if fp8 else 2)
    copies = max(4, -(-L2_DEFEAT_BYTES // nbytes))
    dense = "FP8 tensor cores" if fp8 else "cuBLAS"
    for m in rows:
        cublas, skinny = case(name, m, copies, fp8)
        base = graph_time_us(cublas, copies)
        timed = []
        for config in candidates(name, m, fp8):
            try:
                us = graph_time_us(lambda i, c=config, s=skinny: s(i, c), copies)
            except Exception as error:  # shapes that exceed shared memory or registers
                print(f"  skip {config}: {type(error).__name__}")
                continue
            timed.append((us, config))
        timed.sort(key=lambda item: item[0])
        print(
            f"{name} N={n} K={k} rows={m}: {dense} {base:.1f} us "
            f"({nbytes / base / 1e3:.0f} GB/s); skinny best {timed[0][0]:.1f} us "
            f"({nbytes / timed[0][0] / 1e3:.0f} GB/s), x{base / timed[0][0]:.2f}",
            flush=True,
        )
        for us, config in timed[:4]:
            print(f"    {us:7.1f} us  {config}", flush=True)


def main() -> None:
    parser = CLIParser(prog="python -m benchmarks.tune_linear", description=__doc__)
    parser.add_argument(
        "--rows", type=int, nargs="+", default=[1, 16, 32, 64], help="rows per pass"
    )
    parser.add_argument(
        "--shapes", nargs="+", default=OURO_SHAPES, choices=list(SHAPES), help="layer shapes"
    )
    parser.add_argument(
        "--jobs", type=int, default=8, help="processes that compile launch shapes first"
    )
    parser.add_argument("--fp8", action="store_true", help="float8 weights (default: bf16)")
    args = parser.parse_args()
    parser.require_cuda()
    tiles = sorted({tile_rows(r) for r in args.rows})
    jobs = [(name, m, args.fp8) for name in args.shapes for m in tiles]
    with multiprocessing.get_context("spawn").Pool(args.jobs) as pool:
        for _ in pool.imap_unordered(compile_all, jobs):
            pass
    for name in args.shapes:
        tune(name, args.rows, args.fp8)


if __name__ == "__main__":
    main()
