"""Time the per-row kernels of a pass in their launch variants, at Ouro-1.4B head sizes
(16 heads of 128, 16 KV heads, 4 planes), 24 launches per CUDA graph as the 24 layers run:

- paged (decode) attention: one program per row ("plain") against the bounded grid of a
  captured prompt pass (programs that loop over rows), by programs, warps and key tile;
- RoPE + KV write: a program per row and head against one per row.

Every row reads its own K/V blocks (no two rows share a block, so nothing stays in L2 as it
would for requests with one prompt). Prints one JSON line per case (microseconds per launch).

python -m benchmarks.probe_pass_kernels
"""

from __future__ import annotations

import json

import torch

import benchmarks.needs_triton  # noqa: F401 (first: says what is missing)
from benchmarks.graph_timing import graph_time_us
from vllm_rlt.cli_parser import CLIParser
from vllm_rlt.kernels.decode_attention import _paged_attention_kernel
from vllm_rlt.kernels.head_lanes import head_range
from vllm_rlt.kernels.pdl import launch_options
from vllm_rlt.kernels.rope_kv import _rope_write_kernel, _rope_write_rows_kernel

HEADS, DIM, BLOCK, PLANES, LAYERS = 16, 128, 16, 4, 24


def attention_us(
    rows: int, context: int, programs: int, bounded: bool, warps: int, pdl: bool, block_n: int
) -> float:
    """One launch over `rows` rows of `context` positions, each in its own blocks."""
    per_row = -(-context // BLOCK)
    slots = (rows * per_row + 1) * BLOCK
    k = torch.randn(PLANES * slots, HEADS, DIM, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    n = max(rows, programs)
    q = torch.randn(n, HEADS, DIM, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(q)
    positions = torch.full((n,), context - 1, device="cuda")
    tables = torch.arange(n, device="cuda") % rows
    planes = torch.zeros(n, dtype=torch.int64, device="cuda")
    table = (torch.randperm(rows * per_row, device="cuda").view(rows, per_row) + 1).int()
    count = torch.tensor([rows], device="cuda")

    def launch(_: int) -> None:
        _paged_attention_kernel[(programs, HEADS)](
            q,
            k,
            v,
            positions,  # K/V scales: not read
            positions,
            out,
            positions,
            tables,
            planes,
            table,
            count,
            table.stride(0),
            slots,
            BLOCK,
            DIM**-0.5,
            out,  # split states: not read with one split
            NUM_HEADS=HEADS,
            NUM_KV_HEADS=HEADS,
            HEAD_DIM=DIM,
            HEAD_P2=head_range(DIM),
            KV_SCALED=False,
            BLOCK_N=block_n,
            STAGES=1,
            SPLITS=1,
            GROUP_TILE=0,
            PERSISTENT=bounded,
            num_warps=warps,
            **launch_options(pdl),
        )

    return graph_time_us(launch, LAYERS)


def rope_us(rows: int, by_row: bool, pdl: bool) -> float:
    slots = rows + BLOCK
    k_cache = torch.zeros(PLANES * slots, HEADS, DIM, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.zeros_like(k_cache)
    qkv = torch.randn(rows, 3 * HEADS * DIM, device="cuda", dtype=torch.bfloat16)
    q = torch.empty(rows, HEADS, DIM, device="cuda", dtype=torch.bfloat16)
    positions = torch.randint(0, 4000, (rows,), device="cuda")
    cos = torch.randn(4096, DIM, device="cuda", dtype=torch.bfloat16)
    sin = torch.randn_like(cos)
    entry = torch.arange(rows, device="cuda")
    lo = torch.zeros(rows, dtype=torch.int64, device="cuda")
    args = (qkv, q, k_cache, v_cache, positions, positions, positions, cos, sin, entry)
    args += (lo, lo + 1, qkv.stride(0), slots)  # the K/V scales (positions) are not read
    shape = dict(NUM_HEADS=HEADS, NUM_KV_HEADS=HEADS, HEAD_DIM=DIM, HEAD_P2=head_range(DIM))
    shape |= dict(PLANES=PLANES, KV_SCALED=False)

    def launch(_: int) -> None:
        if by_row:
            _rope_write_rows_kernel[(rows,)](
                *args,
                **shape,
                HEADS_P2=HEADS,
                KV_HEADS_P2=HEADS,
                num_warps=8,
                **launch_options(pdl),
            )
        else:
            _rope_write_kernel[(rows, 2 * HEADS)](*args, **shape, **launch_options(pdl))

    return graph_time_us(launch, LAYERS)


def main() -> None:
    parser = CLIParser(prog="python -m benchmarks.probe_pass_kernels", description=__doc__)
    parser.add_argument(
        "--pdl",
        action="store_true",
        help="launch with programmatic "
        "dependent launch, as the engine does on Hopper (default: off)",
    )
    args = parser.parse_args()
    parser.require_cuda()
    for rows, context in ((32, 67), (64, 67), (256, 67), (512, 67), (512, 300)):
        cases = [("plain", rows, False, 2, 128), ("plain", rows, False, 2, 64)]
        cases += [("bounded", p, True, w, 128) for p, w in ((128, 2), (128, 4), (512, 2))]
        for name, programs, bounded, warps, block_n in cases:
            us = attention_us(rows, context, programs, bounded, warps, args.pdl, block_n)
            print(
                json.dumps(
                    {
                        "kernel": "paged_attention",
                        "rows": rows,
                        "context": context,
                        "grid": name,
                        "programs": programs,
                        "warps": warps,
                        "block_n": block_n,
                        "us": round(us, 2),
                    }
                ),
                flush=True,
            )
    for rows in (1, 8, 64, 512, 1024):
        for by_row in (False, True):
            us = rope_us(rows, by_row, args.pdl)
            print(
                json.dumps(
                    {
                        "kernel": "rope_write",
                        "rows": rows,
                        "grid": "row" if by_row else "row x head",
                        "us": round(us, 2),
                    }
                ),
                flush=True,
            )


if __name__ == "__main__":
    main()
