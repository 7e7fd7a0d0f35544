"""Decode attention alone, CUDA kernel (kernels/paged_attention_cuda.py) against the Triton
row kernel it replaces, at the shapes the decode-attention target names (256 and 512 rows
at 80 positions, 32-64 rows at 1,024-8,192), at Huginn-0125's and Nanbeige's heads, and
at few rows with long contexts (split runs): each launch (with the split combine where the
pass splits) as a CUDA graph, its key and value bytes against the copy bandwidth measured
first. Every cache is larger than the L2, blocks in random order. Needs a CUDA GPU.

python -m benchmarks.probe_paged_attention --output probe.json
"""

from __future__ import annotations

import json
import sys

import torch

import benchmarks.needs_triton  # noqa: F401 (first: says what is missing)
from benchmarks.graph_timing import graph_time_us
from vllm_rlt.bench.device_figures import copy_bandwidth
from vllm_rlt.cli_parser import CLIParser
from vllm_rlt.ops.metadata import AttentionMetadata

# (name, rows, context, heads, kv heads, head size)
CASES = (
    ("ouro", 64, 80, 16, 16, 128),
    ("ouro", 256, 80, 16, 16, 128),
    ("ouro", 512, 80, 16, 16, 128),
    ("ouro", 32, 1024, 16, 16, 128),
    ("ouro", 64, 1024, 16, 16, 128),
    ("ouro", 32, 8192, 16, 16, 128),
    ("ouro", 64, 8192, 16, 16, 128),
    ("huginn", 64, 320, 55, 55, 96),
    ("nanbeige", 64, 1024, 48, 8, 128),
    # few rows at long contexts: split runs (L2-sized caches excluded: 134-346 MB)
    ("ouro", 1, 16384, 16, 16, 128),
    ("ouro", 4, 4096, 16, 16, 128),
    ("huginn", 4, 4096, 55, 55, 96),
)
KV_DTYPES = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}
BLOCK = 16


def _problem(rows, context, heads, kv_heads, dim, kv_dtype):
    """Queries, a cache of one plane with each row's blocks in random order, every row at
    position context - 1, and per-head scales (read for float8 only)."""
    per_row = -(-context // BLOCK)
    slots = (rows * per_row + 1) * BLOCK
    q = torch.randn(rows, heads, dim, device="cuda").to(torch.bfloat16)
    k = torch.randn(slots, kv_heads, dim, device="cuda").to(kv_dtype)
    v = torch.randn(slots, kv_heads, dim, device="cuda").to(kv_dtype)
    order = torch.randperm(rows * per_row, device="cuda").view(rows, per_row)
    positions = torch.full((rows,), context - 1, device="cuda")
    meta = AttentionMetadata(
        positions=positions,
        row_tables=torch.arange(rows, device="cuda"),
        read_plane=torch.zeros(rows, dtype=torch.int64, device="cuda"),
        write_lo=positions,  # not read by decode attention
        write_hi=positions,
        row_entry=positions,
        block_table=order,
        planes=1,
        slots_per_plane=slots,
        block_size=BLOCK,
        dummy_entry=0,
    )
    scales = torch.rand(2, kv_heads, device="cuda") + 0.5
    return q, (k, v, scales[0], scales[1]), meta


def _kernels(ops, q, caches, meta, scaled: bool):
    """(CUDA, Triton) launches of one decode attention over every row, each with the
    split combine where the engine would split."""
    from vllm_rlt.kernels import paged_attention_cuda
    from vllm_rlt.kernels.decode_attention import attention_shape
    from vllm_rlt.ops.triton_ops import decode_splits

    rows, heads, dim = q.shape
    kv_heads = caches[0].shape[1]
    out = torch.empty_like(q)
    splits = decode_splits(rows, ops._head_grid(heads, kv_heads)[0])
    parts = ops._split_parts(out, splits)
    cuda_splits = paged_attention_cuda.decode_splits(rows, kv_heads)
    cuda_parts = ops._split_parts(out, cuda_splits)
    shape = attention_shape(heads, kv_heads, dim, scaled)
    scale = dim**-0.5

    def cuda(_):
        args = (q, caches, scaled, out, cuda_parts, meta, rows, cuda_splits)
        paged_attention_cuda.paged_decode(*args, None, scale, False)
        ops._combine_splits(cuda_parts, caches[3], out, rows, shape, cuda_splits)

    def triton(_):
        args = (q, caches, out, parts, meta, rows, meta.positions, False, shape, scale)
        ops._triton_decode(*args)
        ops._combine_splits(parts, caches[3], out, rows, shape, splits)

    return cuda, triton, out, (cuda_splits, splits)


def main(argv: list[str] | None = None) -> int:
    parser = CLIParser(prog="python -m benchmarks.probe_paged_attention", description=__doc__)
    parser.add_argument("--output", default=None, help="JSON of every figure (default: none)")
    args = parser.parse_args(argv)
    parser.require_cuda()
    from vllm_rlt.kernels.paged_attention_cuda import fits_cuda_decode
    from vllm_rlt.ops.triton_ops import TritonOps

    bandwidth = copy_bandwidth(torch.device("cuda"))
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s", file=sys.stderr)
    ops = TritonOps()
    ops.pdl = False  # each kernel timed alone, not overlapped with the one before
    report = {"bandwidth": bandwidth, "device": torch.cuda.get_device_name(), "cases": []}
    for name, rows, context, heads, kv_heads, dim in CASES:
        for kv, kv_dtype in KV_DTYPES.items():
            q, caches, meta = _problem(rows, context, heads, kv_heads, dim, kv_dtype)
            assert fits_cuda_decode(q, caches[0], kv_heads)
            cuda, triton, out, splits = _kernels(ops, q, caches, meta, kv == "fp8")
            cuda(0)
            got = out.float().clone()
            triton(0)
            error = ((got - out.float()).norm() / out.float().norm()).item()
            assert error < 1e-2, f"{name} {rows}x{context} {kv}: CUDA against Triton {error}"
            kv_bytes = 2 * rows * context * kv_heads * dim * kv_dtype.itemsize
            figures = {"name": name, "rows": rows, "context": context, "kv": kv}
            figures |= {"splits": {"cuda": splits[0], "triton": splits[1]}, "kv_bytes": kv_bytes}
            for kernel, fn in (("cuda", cuda), ("triton", triton)):
                us = sorted(graph_time_us(fn, 10) for _ in range(3))[1]  # median of 3
                figures[kernel] = {"us": us, "of_bandwidth": kv_bytes / (us * 1e-6) / bandwidth}
            report["cases"].append(figures)
            c, t = figures["cuda"], figures["triton"]
            print(
                f"{name:8s} rows {rows:3d} context {context:5d} {kv:4s}: CUDA {c['us']:8.1f} us"
                f" ({c['of_bandwidth']:.2f} of bandwidth), Triton {t['us']:8.1f} us"
                f" ({t['of_bandwidth']:.2f}), {t['us'] / c['us']:.2f}x"
            )
            del q, caches, meta, out
    if args.output:
        with open(args.output, "w") as out_file:
            json.dump(report, out_file, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
