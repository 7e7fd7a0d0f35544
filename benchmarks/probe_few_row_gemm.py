"""The few-row products, float8 and bf16 weights (kernels/csrc/few_row_gemm.cu), against
the Triton paths they replace, on the Ouro-1.4B layer shapes: the four projections of 24
layers in a row as a pass runs them (with the residual add and norms after o and down, as
an Ouro layer has them), each layer with weights of its own (so the weights come from HBM,
not L2). Prints microseconds per layer, each against its weight bytes over the copy
bandwidth measured first. Needs a CUDA GPU.

python -m benchmarks.probe_few_row_gemm --rows 1 2 4 8 16 --output probe.json
"""

from __future__ import annotations

import json
import sys

import torch

from vllm_rlt.cli_parser import CLIParser

# Ouro-1.4B: (name, N, K, SiLU-mul epilogue)
SHAPES = (("qkv", 6144, 2048, False), ("o", 2048, 2048, False), ("gate_up", 11264, 2048, True))
SHAPES += (("down", 2048, 5632, False),)
LAYERS = 24


def copy_bandwidth() -> float:
    """Bytes per second of a large device-to-device copy (read plus write)."""
    import triton.testing

    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), rep=200, return_mode="median")
    return 2 * src.numel() / (ms * 1e-3)


def _variants():
    """name -> (weight dtype, whether the CUDA kernel may serve)."""
    return {
        "cuda fp8": ("fp8", True),
        "triton fp8": ("fp8", False),
        "cuda bf16": ("bf16", True),
        "triton bf16": ("bf16", False),
    }


def _weights(kind: str, count: int):
    from vllm_rlt.layers.fp8 import Fp8Weight

    layers = []
    for index in range(count):
        gen = torch.Generator(device="cuda").manual_seed(index)
        layer = {}
        for name, n, k, _ in SHAPES:
            w = (torch.randn(n, k, device="cuda", generator=gen) / k**0.5).to(torch.bfloat16)
            layer[name] = Fp8Weight.quantize(w) if kind == "fp8" else w
        layers.append(layer)
    return layers


def _project(ops, x, weight, silu):
    return ops.linear_silu_mul(x, weight) if silu else ops.linear(x, weight)


def main(argv: list[str] | None = None) -> int:
    parser = CLIParser(prog="python -m benchmarks.probe_few_row_gemm", description=__doc__)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16], help="rows a pass")
    parser.add_argument("--output", default=None, help="JSON of every figure (default: none)")
    args = parser.parse_args(argv)
    parser.require_cuda()
    import triton.testing

    from vllm_rlt.kernels import few_row_gemm
    from vllm_rlt.ops.triton_ops import TritonOps

    defaults = few_row_gemm.FP8_CUDA_ROWS, few_row_gemm.BF16_CUDA_ROWS
    bandwidth = copy_bandwidth()
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s", file=sys.stderr)
    ops = TritonOps()
    report = {"bandwidth": bandwidth, "device": torch.cuda.get_device_name(), "rows": {}}
    weights = {kind: _weights(kind, LAYERS) for kind in ("fp8", "bf16")}
    for rows in args.rows:
        x = {
            name: torch.randn(rows, k, device="cuda").to(torch.bfloat16) for name, _, k, _ in SHAPES
        }
        residual = torch.randn(rows, 2048, device="cuda").to(torch.bfloat16)
        norms = (torch.ones(2048, device="cuda", dtype=torch.bfloat16),) * 2 + (1e-6,)
        figures = {}
        for variant, (kind, cuda) in _variants().items():
            few_row_gemm.FP8_CUDA_ROWS = few_row_gemm.BF16_CUDA_ROWS = 16 if cuda else 0
            layer_bytes = 0
            for name, n, k, silu in SHAPES:
                weight = weights[kind][0][name]
                taken = few_row_gemm.takes_few_row(x[name], weight)
                assert taken == cuda, f"{variant} {name}: the CUDA kernel taken: {taken}"
                got = _project(ops, x[name], weight, silu)
                dense = weight.dequantize(torch.float32) if kind == "fp8" else weight.float()
                want = (x[name].float() @ dense.T).to(torch.bfloat16)
                if silu:
                    want = torch.nn.functional.silu(want[:, 0::2]) * want[:, 1::2]
                error = (got.float() - want.float()).norm() / want.float().norm()
                # float8 activations (W8A8 from 8 rows) round x too: a few percent
                bound = 5e-2 if kind == "fp8" else 2e-2
                assert error < bound, f"{variant} {name} rows {rows}: relative error {error}"
                layer_bytes += n * k * (1 if kind == "fp8" else 2)

            def chain(kind=kind, x=x, residual=residual, norms=norms):
                for layer in weights[kind]:
                    for name, _, _, silu in SHAPES:
                        if name in ("o", "down"):  # then the residual add and norms
                            ops.linear_add_rms_norm2(residual, x[name], layer[name], *norms)
                        else:
                            _project(ops, x[name], layer[name], silu)

            ms = triton.testing.do_bench_cudagraph(chain, rep=100, return_mode="median")
            per_layer = ms * 1e3 / LAYERS
            floor = layer_bytes / bandwidth * 1e6
            figures[variant] = {"us_per_layer": per_layer, "bytes_floor_us": floor}
            print(
                f"rows {rows:3d}  {variant:12s}  {per_layer:7.2f} us a layer "
                f"(bytes floor {floor:5.2f} us, {floor / per_layer:.2f} of it)"
            )
        report["rows"][rows] = figures
    few_row_gemm.FP8_CUDA_ROWS, few_row_gemm.BF16_CUDA_ROWS = defaults
    if args.output:
        with open(args.output, "w") as out:
            json.dump(report, out, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
