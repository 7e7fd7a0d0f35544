"""Time the decode attention kernel over launch shapes at Ouro-1.4B head sizes.

python -m benchmarks.tune_attention

Cases: (rows, context) = (1, 96), (8, 96), (64, 96), (256, 96), (512, 96), (32, 1100).
"""

from __future__ import annotations

import itertools

import torch

import benchmarks.needs_triton  # noqa: F401 (first: says what is missing)
from benchmarks.graph_timing import graph_time_us
from vllm_rlt.cli_parser import CLIParser
from vllm_rlt.layers.rotary import RotaryEmbedding
from vllm_rlt.ops import triton_ops
from vllm_rlt.ops.triton_ops import TritonOps
from vllm_rlt.worker.pass_inputs import KVGeometry, build_metadata, gather_rows


class _State:
    def __init__(self, block_table, loop, position):
        self.block_table, self.loop, self.position = block_table, loop, position


def time_case(rows: int, context: int, heads: int = 16, dim: int = 128, planes: int = 4) -> None:
    bs = 16
    per_seq = -(-(context + 1) // bs)
    blocks = rows * per_seq
    geo = KVGeometry(planes, bs, blocks, True)
    table = torch.arange(blocks, device="cuda").view(rows, per_seq)
    table = torch.cat([table, torch.full((1, per_seq), blocks, device="cuda")])
    state = _State(
        table,
        torch.zeros(rows + 1, dtype=torch.int64, device="cuda"),
        torch.full((rows + 1,), context - 1, dtype=torch.int64, device="cuda"),
    )
    meta = build_metadata(
        gather_rows(torch.arange(rows, device="cuda"), (), state, geo), (), state, geo, 0, False
    )
    qkv = torch.randn(rows, 3 * heads * dim, device="cuda", dtype=torch.bfloat16)
    cache = (planes * geo.slots_per_plane, heads, dim)
    k = torch.randn(cache, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    rotary = RotaryEmbedding(dim, 1e6, context + 1, torch.bfloat16, "cuda")
    ops = TritonOps()
    scale = dim**-0.5
    results = []
    for block_n, stages, warps in itertools.product((32, 64, 128), (1, 2, 3), (2, 4, 8)):
        triton_ops.DECODE_BLOCK_N = triton_ops.MANY_ROWS_BLOCK_N = block_n
        triton_ops.DECODE_STAGES = stages
        triton_ops.FEW_ROWS_WARPS = triton_ops.MANY_ROWS_WARPS = warps
        us = graph_time_us(
            lambda _: ops.attention(qkv, heads, heads, k, v, meta, rotary, scale), 10
        )
        results.append((us, block_n, stages, warps))
    results.sort()
    kv_bytes = rows * context * heads * dim * 2 * 2
    best = results[0]
    print(
        f"rows {rows} context {context}: best {best[0]:.1f} us (BLOCK_N {best[1]}, stages "
        f"{best[2]}, warps {best[3]}), {kv_bytes / best[0] / 1e3:.0f} GB/s"
    )
    by_shape = {r[1:]: r[0] for r in results}
    for shape in ((32, 1, 2), (64, 1, 2), (128, 1, 2), (64, 1, 4), (128, 1, 4), (64, 2, 4)):
        block_n, stages, warps = shape
        print(f"    BLOCK_N {block_n:>3} stages {stages} warps {warps}: {by_shape[shape]:.1f} us")


def main() -> None:
    parser = CLIParser(prog="python -m benchmarks.tune_attention", description=__doc__)
    parser.parse_args()
    parser.require_cuda()
    for rows, context in ((1, 96), (8, 96), (64, 96), (256, 96), (512, 96), (32, 1100)):
        time_case(rows, context)


if __name__ == "__main__":
    main()
