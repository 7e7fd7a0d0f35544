"""FP8 tensor-core products at 32-512 rows: cuBLAS (`torch._scaled_mm`) against the Triton
W8A8 kernel (kernels/w8a8_gemm.py) in candidate tiles sized for few rows, with split-K, on
the Ouro-1.4B layer shapes. The activations come
already in float8 with their per-token scales, as the norms now hand them on, so only the
product is timed. Every tile runs twice: as it is, and promoting each K chunk's product into
a float32 sum (label suffix "p"); each error is against the float32 product of the same
float8 inputs. Each of 24 layers has weights of its own (HBM, not L2), and every figure
is set against the weight bytes over the copy bandwidth measured first. Split-K tiles of o
and down write float32 partials, which the engine's add + norms kernel already sums (PARTS),
so their figure is the product's whole cost there; those of qkv and gate/up sum their
slices in the kernel (label suffix "r"), as their consumers need the finished product.
Needs a CUDA GPU.

With --table (no GPU needed) the reports given, --output files of one GPU model, become that
model's table of tiles: per layer class and probed row count the fastest tile where it beats
cuBLAS (a promoting tile where it is within 3% of the fastest), else cuBLAS; passes with
fewer rows than the fewest probed keep the built-in table's tiles. It goes to the user's
folder (VLLM_RLT_CACHE_DIR/w8a8_tuned, default ~/.cache/vllm-rlt/w8a8_tuned), where the
engine on this machine takes it; tables shipped with the package live in
vllm_rlt/ops/w8a8_tuned/.

python -m benchmarks.probe_w8a8_tiles --rows 32 64 128 256 512 --output probe.json
python -m benchmarks.probe_w8a8_tiles --table probe.json
"""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

import torch

from benchmarks.graph_timing import graph_time_us
from benchmarks.probe_few_row_gemm import LAYERS, SHAPES, copy_bandwidth
from vllm_rlt.cli_parser import CLIParser
from vllm_rlt.ops.w8a8_tables import (
    W8A8_PLANS,
    best_tiles,
    layer_class,
    parse_label,
    table_dirs,
    table_file,
    table_json,
    tile_label,
)

# Candidate tiles: (BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K, warps, stages), as W8A8Tile takes them
# (built in _case, so that --help needs no Triton).
TILES = (
    (64, 64, 128, 1, 4, 4),
    (64, 128, 128, 1, 4, 4),
    (64, 64, 128, 2, 4, 4),
    (64, 64, 128, 4, 4, 4),
    (128, 64, 128, 1, 4, 4),
    (128, 128, 128, 1, 8, 3),
    (64, 32, 128, 1, 4, 4),
    (64, 32, 128, 2, 4, 4),
    (64, 32, 256, 1, 4, 3),
    (64, 64, 256, 1, 4, 3),
    (32, 64, 128, 1, 4, 4),
    (64, 64, 128, 1, 4, 6),
)


def _case(rows: int, name: str, n: int, k: int, bandwidth: float) -> dict:
    from vllm_rlt.kernels.fp8_rows import fp8_rows_linear, quantize_rows
    from vllm_rlt.kernels.w8a8_gemm import w8a8_gemm
    from vllm_rlt.kernels.w8a8_tile import W8A8Tile
    from vllm_rlt.layers.fp8 import Fp8Weight

    gen = torch.Generator(device="cuda").manual_seed(rows + n)
    weights = [
        Fp8Weight.quantize(torch.randn(n, k, device="cuda", generator=gen) / k**0.5)
        for _ in range(LAYERS)
    ]
    x = quantize_rows(torch.randn(rows, k, device="cuda", generator=gen).to(torch.bfloat16))
    bound_us = n * k / bandwidth * 1e6  # the weight's bytes, read once
    w0 = weights[0]
    want = (x.data.float() * x.scale.view(-1, 1)) @ (w0.data.float() * w0.scale.view(-1, 1)).T

    def error(got: torch.Tensor) -> float:
        return ((got.float() - want).norm() / want.norm()).item()

    result = {"rows": rows, "shape": name, "bound_us": bound_us}
    result["cublas_us"] = graph_time_us(lambda i: fp8_rows_linear(x, weights[i]), LAYERS)
    result["cublas_relative_error"] = error(fp8_rows_linear(x, w0))
    tiles = [W8A8Tile(*fields, promote=p) for fields in TILES for p in (False, True)]
    for tile in tiles:
        if tile.split_k > 1 and n > 2048:  # qkv, gate/up: their consumers need the sum
            tile = replace(tile, reduce=True)
        got = w8a8_gemm(x, w0, tile).float()
        got = got.sum(0) if got.dim() == 3 else got
        us = graph_time_us(lambda i, t=tile: w8a8_gemm(x, weights[i], t), LAYERS)
        result[tile_label(tile)] = {"us": us, "relative_error": error(got)}
    return result


def _write_table(parser: CLIParser, reports: list[str], out: str | None) -> int:
    """The table of tiles from probe reports of one GPU model (module docstring)."""
    loaded = []
    for path in reports:
        try:
            with open(path) as f:
                loaded.append(json.load(f))
        except (OSError, ValueError) as exc:
            parser.error(f"--table: cannot read {path}: {exc}")
    if not all(isinstance(r, dict) and "device" in r and "cases" in r for r in loaded):
        parser.error("--table: give reports this probe wrote with --output")
    devices = {str(report["device"]) for report in loaded}
    if len(devices) != 1:
        parser.error(f"--table: the reports come from {len(devices)} GPU models; give one's")
    device = devices.pop()
    classes = {name: layer_class(n, k) for name, n, k, _ in SHAPES}
    try:
        cases = [case for report in loaded for case in report["cases"]]
        table = best_tiles(cases, classes, W8A8_PLANS)
    except (KeyError, ValueError, TypeError, AttributeError) as exc:
        parser.error(f"--table: the reports hold no probe cases this tool can read ({exc!r})")
    path = table_file(device, table_dirs()[0]) if out is None else Path(out)
    record = {
        "device": device,
        "made_by": "python -m benchmarks.probe_w8a8_tiles --table "
        + " ".join(Path(report).name for report in reports),
        "probed_with": sorted({str(report.get("versions", "unrecorded")) for report in loaded}),
        "rows": sorted({case["rows"] for case in cases}),
    }
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(table_json(record, table))
    except OSError as exc:
        parser.error(f"--table: cannot write {path}: {exc} (choose another with --table-out)")
    print(f"wrote {path}", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = CLIParser(prog="python -m benchmarks.probe_w8a8_tiles", description=__doc__)
    parser.add_argument(
        "--rows", type=int, nargs="+", default=[32, 64, 128, 256, 512], help="rows per product"
    )
    parser.add_argument("--output", default=None, help="JSON of every figure (default: none)")
    parser.add_argument(
        "--table",
        nargs="+",
        default=None,
        help="probe reports to turn into a GPU model's table, with no GPU (default: none: probe)",
    )
    parser.add_argument(
        "--table-out",
        default=None,
        help="where --table writes (default: the GPU model's file in the user's folder)",
    )
    args = parser.parse_args(argv)
    if args.table:
        return _write_table(parser, args.table, args.table_out)
    parser.require_cuda()
    bandwidth = copy_bandwidth()
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s", file=sys.stderr)
    import triton

    versions = f"torch {torch.__version__}, triton {triton.__version__}"
    report = {"bandwidth": bandwidth, "device": torch.cuda.get_device_name(), "cases": []}
    report["versions"] = versions
    for rows in args.rows:
        for name, n, k, _ in SHAPES:
            case = _case(rows, name, n, k, bandwidth)
            report["cases"].append(case)
            tiles = [(v["us"], label) for label, v in case.items() if isinstance(v, dict)]
            best = min(t for t in tiles if not parse_label(t[1]).promote)
            promoted = min(t for t in tiles if parse_label(t[1]).promote)
            print(
                f"{rows:4d} rows {name:8s} bound {case['bound_us']:6.1f} us  cuBLAS "
                f"{case['cublas_us']:6.1f}  best Triton {best[0]:6.1f} ({best[1]})  promoted "
                f"{promoted[0]:6.1f} ({promoted[1]})",
                file=sys.stderr,
            )
    if args.output:
        with open(args.output, "w") as f:
            json.dump(report, f, indent=2)
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
