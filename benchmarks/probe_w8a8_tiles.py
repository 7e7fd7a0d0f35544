"""FP8 tensor-core products at 32-512 rows: cuBLAS (`torch._scaled_mm`, what the engine runs
above 16 rows) against a Triton W8A8 kernel whose tiles are sized for few rows, with split-K
for the narrow projections (o and down), on the Ouro-1.4B layer shapes. The activations come
already in float8 with their per-token scales, as the norms now hand them on, so only the
product is timed. Each of 24 layers has weights of its own (HBM, not L2), and every figure
is set against the weight bytes over the copy bandwidth measured first. Split-K variants
write float32 partials, which the engine's add + norms kernel already sums (PARTS), so the
figure for o and down is the product's whole cost there. Needs a CUDA GPU.

python -m benchmarks.probe_w8a8_tiles --rows 32 64 128 256 512 --output probe.json
"""

from __future__ import annotations

import functools
import json
import sys

import torch

from benchmarks.graph_timing import graph_time_us
from benchmarks.probe_few_row_gemm import LAYERS, SHAPES, copy_bandwidth
from vllm_rlt.cli_parser import CLIParser

# (BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K, warps, stages)
TILES = (
    (64, 64, 128, 1, 4, 4),
    (64, 128, 128, 1, 4, 4),
    (64, 64, 128, 2, 4, 4),
    (64, 64, 128, 4, 4, 4),
    (128, 64, 128, 1, 4, 4),
    (128, 128, 128, 1, 8, 3),
)


@functools.cache
def w8a8_kernel():
    """The Triton kernel, built on first use (so `--help` needs no Triton)."""
    import triton
    import triton.language as tl

    @triton.jit
    def _w8a8_kernel(
        a_ptr,  # [M, K] float8, row-major
        b_ptr,  # [N, K] float8, row-major (the weight)
        a_scale_ptr,  # [M] float32
        b_scale_ptr,  # [N] float32
        c_ptr,  # [M, N] bf16, or [SPLIT_K, M, N] float32 partials
        M,
        N,
        K,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        SPLIT_K: tl.constexpr,
    ):
        """One output tile over one K slice; both scales applied to the float32 accumulator
        (linear, so split-K partials carry them and sum to the scaled product)."""
        tiles_n = tl.cdiv(N, BLOCK_N)
        pid = tl.program_id(0)
        split = tl.program_id(1)
        rows = (pid // tiles_n) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = (pid % tiles_n) * BLOCK_N + tl.arange(0, BLOCK_N)
        per_split = tl.cdiv(K, SPLIT_K * BLOCK_K) * BLOCK_K
        k_start = split * per_split
        ks = tl.arange(0, BLOCK_K)
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        for k0 in range(k_start, tl.minimum(k_start + per_split, K), BLOCK_K):
            a = tl.load(
                a_ptr + rows[:, None].to(tl.int64) * K + (k0 + ks)[None, :],
                mask=(rows[:, None] < M) & ((k0 + ks)[None, :] < K),
                other=0.0,
            )
            b = tl.load(
                b_ptr + cols[None, :].to(tl.int64) * K + (k0 + ks)[:, None],
                mask=(cols[None, :] < N) & ((k0 + ks)[:, None] < K),
                other=0.0,
            )
            acc = tl.dot(a, b, acc)
        a_scale = tl.load(a_scale_ptr + rows, mask=rows < M, other=0.0)
        b_scale = tl.load(b_scale_ptr + cols, mask=cols < N, other=0.0)
        acc = acc * a_scale[:, None] * b_scale[None, :]
        out = c_ptr + split.to(tl.int64) * M * N + rows[:, None].to(tl.int64) * N + cols[None, :]
        mask = (rows[:, None] < M) & (cols[None, :] < N)
        tl.store(out, acc.to(c_ptr.dtype.element_ty), mask=mask)

    return _w8a8_kernel


def w8a8(x, weight, tile) -> torch.Tensor:
    """x (Fp8Rows) @ weight.T with one of TILES: [M, N] bf16, or [SPLIT_K, M, N] float32."""
    block_m, block_n, block_k, split_k, warps, stages = tile
    m, k = x.shape
    n = weight.shape[0]
    if split_k == 1:
        out = torch.empty(m, n, dtype=torch.bfloat16, device=x.data.device)
    else:
        out = torch.empty(split_k, m, n, dtype=torch.float32, device=x.data.device)
    grid = (-(-m // block_m) * -(-n // block_n), split_k)
    w8a8_kernel()[grid](
        x.data,
        weight.data,
        x.scale,
        weight.scale,
        out,
        m,
        n,
        k,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        SPLIT_K=split_k,
        num_warps=warps,
        num_stages=stages,
    )
    return out


def _case(rows: int, name: str, n: int, k: int, bandwidth: float) -> dict:
    from vllm_rlt.kernels.fp8_rows import fp8_rows_linear, quantize_rows
    from vllm_rlt.layers.fp8 import Fp8Weight

    gen = torch.Generator(device="cuda").manual_seed(rows + n)
    weights = [
        Fp8Weight.quantize(torch.randn(n, k, device="cuda", generator=gen) / k**0.5)
        for _ in range(LAYERS)
    ]
    x = quantize_rows(torch.randn(rows, k, device="cuda", generator=gen).to(torch.bfloat16))
    bound_us = n * k / bandwidth * 1e6  # the weight's bytes, read once
    want = fp8_rows_linear(x, weights[0]).float()
    result = {"rows": rows, "shape": name, "bound_us": bound_us}
    result["cublas_us"] = graph_time_us(lambda i: fp8_rows_linear(x, weights[i]), LAYERS)
    for tile in TILES:
        if tile[3] > 1 and n > 2048:
            continue  # split-K only for the narrow projections
        got = w8a8(x, weights[0], tile).float()
        got = got.sum(0) if got.dim() == 3 else got
        error = ((got - want).norm() / want.norm()).item()
        label = "x".join(map(str, tile[:4]))
        us = graph_time_us(lambda i, t=tile: w8a8(x, weights[i], t), LAYERS)
        result[label] = {"us": us, "relative_error": error}
    return result


def main(argv: list[str] | None = None) -> int:
    parser = CLIParser(prog="python -m benchmarks.probe_w8a8_tiles", description=__doc__)
    parser.add_argument(
        "--rows", type=int, nargs="+", default=[32, 64, 128, 256, 512], help="rows per product"
    )
    parser.add_argument("--output", default=None, help="JSON of every figure (default: none)")
    args = parser.parse_args(argv)
    parser.require_cuda()
    bandwidth = copy_bandwidth()
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s", file=sys.stderr)
    report = {"bandwidth": bandwidth, "device": torch.cuda.get_device_name(), "cases": []}
    for rows in args.rows:
        for name, n, k, _ in SHAPES:
            case = _case(rows, name, n, k, bandwidth)
            report["cases"].append(case)
            best = min((v["us"], label) for label, v in case.items() if isinstance(v, dict))
            print(
                f"{rows:4d} rows {name:8s} bound {case['bound_us']:6.1f} us  cuBLAS "
                f"{case['cublas_us']:6.1f}  best Triton {best[0]:6.1f} ({best[1]})",
                file=sys.stderr,
            )
    if args.output:
        with open(args.output, "w") as f:
            json.dump(report, f, indent=2)
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
