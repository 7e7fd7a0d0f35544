"""Time the skinny linear kernel over launch shapes against cuBLAS, at Ouro-1.4B layer shapes.

Each case runs back to back in a CUDA graph over enough weight copies to defeat the L2 cache,
as the layers of a real pass do.

python -m benchmarks.tune_linear [--rows 1 8 16 32 64]
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F

from benchmarks.graph_timing import graph_time_us
from vllm_rlt.attention.triton_backend import TritonOps
from vllm_rlt.entrypoints.parser import CLIParser
from vllm_rlt.kernels.skinny_linear import SkinnyConfig, skinny_linear

# name: (N, K, SiLU-mul epilogue)
SHAPES = {
    "qkv": (6144, 2048, False),
    "o": (2048, 2048, False),
    "gate_up": (11264, 2048, True),
    "down": (2048, 5632, False),
    "lm_head": (49152, 2048, False),
}
L2_DEFEAT_BYTES = 160 * 2**20


def tune(name: str, rows: list[int], configs: list[SkinnyConfig]) -> None:
    n, k, silu = SHAPES[name]
    nbytes = n * k * 2
    copies = max(4, -(-L2_DEFEAT_BYTES // nbytes))
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
    ops = TritonOps()
    for m in rows:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        if silu:  # what the skinny epilogue replaces: cuBLAS, then the SiLU-mul kernel
            cublas = graph_time_us(lambda i, x=x: ops.silu_mul(F.linear(x, weights[i])), copies)
        else:
            cublas = graph_time_us(lambda i, x=x: F.linear(x, weights[i]), copies)
        timed = []
        for config in configs:
            try:
                us = graph_time_us(
                    lambda i, x=x, c=config: skinny_linear(x, weights[i], c, silu_mul=silu), copies
                )
            except Exception as error:  # shapes that exceed shared memory or registers
                print(f"  skip {config}: {type(error).__name__}")
                continue
            timed.append((us, config))
        timed.sort(key=lambda item: item[0])
        print(
            f"{name} N={n} K={k} rows={m}: cuBLAS {cublas:.1f} us "
            f"({nbytes / cublas / 1e3:.0f} GB/s); skinny best {timed[0][0]:.1f} us "
            f"({nbytes / timed[0][0] / 1e3:.0f} GB/s), x{cublas / timed[0][0]:.2f}"
        )
        for us, config in timed[:4]:
            print(f"    {us:7.1f} us  {config}")


def main() -> None:
    parser = CLIParser(prog="python -m benchmarks.tune_linear", description=__doc__)
    parser.add_argument(
        "--rows", type=int, nargs="+", default=[1, 8, 16, 32, 64], help="rows per pass"
    )
    parser.add_argument(
        "--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES), help="layer shapes"
    )
    args = parser.parse_args()
    configs = [
        SkinnyConfig(block_n, block_k, warps, stages)
        for block_n, block_k, warps, stages in itertools.product(
            (16, 32, 64), (128, 256, 512), (4, 8), (2, 3, 4)
        )
    ]
    for name in args.shapes:
        tune(name, args.rows, configs)


if __name__ == "__main__":
    main()
