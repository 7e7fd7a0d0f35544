"""At one row, can a GEMV that holds its weight strip in registers, loaded before it waits
on its predecessor, beat the skinny kernel on a decoder layer's projections?

`probe_grid_barrier` found that on a chain of dependent 8 MB GEMVs a program that loads its
whole 16 x 2,048 strip before the programmatic-dependent wait takes 3.3 us a step against
5.1 us (HBM time 2.0 us). The skinny kernel cannot do the same: its tl.dot tiles stage
through shared memory, which a preloaded strip overflows. This probe times, on the Ouro-1.4B
layer shapes (qkv, o, gate_up, down), a CUDA-core GEMV whose programs each take `block_n`
weight rows, load up to `preload` bytes of them (whole columns from the left, a power of
two of them) into registers before the wait and stream the rest in 256-column chunks:

- per shape, a chain of GEMVs of that shape, each over its own weight copy (enough copies
  to defeat the L2 cache), each waiting on the one before (programmatic dependent launch);
- a layer chain: qkv -> o -> gate_up -> down over distinct layers, each reading the leading
  part of the previous output (no norms, no attention: the projections' share of a pass).

The baseline is the skinny kernel with the engine's launch shape for one row, finished
outputs (the engine splits o and down over K and sums the slices in the norm that follows;
that split form is timed too, as `skinny partials`, without the sum). Every variant runs
with programmatic dependent launch in one CUDA graph. With --fp8 the weights are float8
with a scale per output row, as `--quantization fp8` holds them. One JSON line per case:
microseconds per GEMV (or per layer) against the HBM time of its weights.

python -m benchmarks.probe_register_gemv [--fp8] [--layers 8]
"""

from __future__ import annotations

import benchmarks.needs_triton  # noqa: F401 (first: says what is missing)

# isort: split
import json
from collections.abc import Callable

import torch
import triton
import triton.language as tl

from benchmarks.graph_timing import graph_time_us
from vllm_rlt.cli_parser import CLIParser
from vllm_rlt.kernels.pdl import launch_options, pdl_enter
from vllm_rlt.kernels.skinny_linear import skinny_linear, skinny_linear_partials
from vllm_rlt.layers.fp8 import Fp8Weight
from vllm_rlt.ops.linear_plans import linear_plan

SHAPES = {"qkv": (6144, 2048), "o": (2048, 2048), "gate_up": (11264, 2048), "down": (2048, 5632)}
CHUNK = 256  # columns a streaming step loads past the preloaded ones
HBM_BYTES_PER_S = 4.27e12  # H200 HBM3e, copy bandwidth measured
L2_DEFEAT_BYTES = 160 * 2**20
# (weight rows a program, bytes preloaded a program, warps)
VARIANTS = ((16, 0, 4), (16, 32768, 8), (16, 65536, 8), (8, 32768, 4), (32, 65536, 8))


@triton.jit
def _register_gemv_kernel(
    w_ptr,
    scale_ptr,
    x_ptr,
    out_ptr,
    N,
    K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRELOAD_K: tl.constexpr,
    BLOCK_K: tl.constexpr,
    W_SCALED: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """out[n] = sum_k w[n, k] x[k] for this program's BLOCK_N rows; the first PRELOAD_K
    columns of them load before the wait on the predecessor (which writes x)."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    if PRELOAD_K > 0:
        k0 = tl.arange(0, PRELOAD_K)
        w0 = tl.load(w_ptr + rows[:, None] * K + k0[None, :], mask=row_ok[:, None], other=0.0)
    pdl_enter(USE_PDL)
    acc = tl.zeros((BLOCK_N,), tl.float32)
    if PRELOAD_K > 0:
        x0 = tl.load(x_ptr + k0).to(tl.float32)
        acc += tl.sum(w0.to(tl.float32) * x0[None, :], axis=1)
    ks = tl.arange(0, BLOCK_K)
    for start in tl.range(PRELOAD_K, K, BLOCK_K, num_stages=3):
        w = tl.load(
            w_ptr + rows[:, None] * K + (start + ks)[None, :], mask=row_ok[:, None], other=0.0
        )
        x = tl.load(x_ptr + start + ks).to(tl.float32)
        acc += tl.sum(w.to(tl.float32) * x[None, :], axis=1)
    if W_SCALED:
        acc = acc * tl.load(scale_ptr + rows, mask=row_ok, other=0.0)
    tl.store(out_ptr + rows, acc.to(out_ptr.dtype.element_ty), mask=row_ok)


def preload_columns(k: int, block_n: int, preload_bytes: int, element_bytes: int) -> int:
    """The columns a program preloads: the largest power of two of chunks within the byte
    budget and K (0: none fits); K being whole chunks, the rest streams in whole chunks."""
    columns = 0
    while columns * 2 <= k and block_n * max(columns * 2, CHUNK) * element_bytes <= preload_bytes:
        columns = max(columns * 2, CHUNK)
    return columns


def register_gemv(
    x: torch.Tensor, weight: torch.Tensor | Fp8Weight, block_n: int, preload: int, warps: int
) -> torch.Tensor:
    """weight @ x for one row x [K] (graph-safe): the probe's kernel."""
    data, scale = weight.tensors() if isinstance(weight, Fp8Weight) else (weight, None)
    n, k = data.shape
    if k % CHUNK:
        raise ValueError(f"K={k} is not a multiple of {CHUNK}")
    out = x.new_empty(n)
    _register_gemv_kernel[(triton.cdiv(n, block_n),)](
        data,
        x if scale is None else scale,
        x,
        out,
        n,
        K=k,
        BLOCK_N=block_n,
        PRELOAD_K=preload_columns(k, block_n, preload, data.element_size()),
        BLOCK_K=CHUNK,
        W_SCALED=scale is not None,
        num_warps=warps,
        **launch_options(True),
    )
    return out


def skinny_gemv(x: torch.Tensor, weight: torch.Tensor | Fp8Weight, split: bool) -> torch.Tensor:
    """The engine's skinny launch for one row: finished outputs, or its K slices unsummed."""
    rows = x[None]
    config = linear_plan(rows, weight, split_ok=split)
    if split and config.split_k > 1:
        return skinny_linear_partials(rows, weight, config, pdl=True)[0, 0]
    return skinny_linear(rows, weight, config, pdl=True)[0]


Gemv = Callable[[torch.Tensor, torch.Tensor | Fp8Weight], torch.Tensor]


def gemvs(fp8: bool) -> dict[str, Gemv]:
    cases: dict[str, Gemv] = {
        "skinny": lambda x, w: skinny_gemv(x, w, False),
        "skinny partials": lambda x, w: skinny_gemv(x, w, True),
    }
    for block_n, preload, warps in VARIANTS:
        name = f"register block_n={block_n} preload={preload // 1024}KB warps={warps}"
        cases[name] = lambda x, w, b=block_n, p=preload, nw=warps: register_gemv(x, w, b, p, nw)
    return cases


def _weight(n: int, k: int, fp8: bool, gen: torch.Generator) -> torch.Tensor | Fp8Weight:
    weight = torch.randn(n, k, device="cuda", generator=gen).div_(k**0.5).to(torch.bfloat16)
    return Fp8Weight.quantize(weight) if fp8 else weight


def _bytes(weight: torch.Tensor | Fp8Weight) -> int:
    return weight.nbytes() if isinstance(weight, Fp8Weight) else weight.numel() * 2


def _print(case: str, variant: str, us: float, hbm_us: float) -> None:
    record = dict(case=case, variant=variant, us=round(us, 2), hbm_us=round(hbm_us, 2))
    print(json.dumps(record | {"of_bandwidth": round(hbm_us / us, 3)}), flush=True)


def _check(variant: str, got: torch.Tensor, want: torch.Tensor) -> None:
    """Within bf16 rounding of the whole vector: a wrong strip or row is far off."""
    error = ((got.float() - want.float()).norm() / want.float().norm()).item()
    if error > 2e-2:
        raise AssertionError(f"{variant}: output off by {error:.3g} (relative)")


def shape_chains(fp8: bool, gen: torch.Generator) -> None:
    """Each shape alone, GEMV after GEMV. They all read one input: under programmatic
    dependent launch a kernel waits for its predecessor to finish whether or not it reads
    its output, so the chain is as dependent as a layer's."""
    for shape, (n, k) in SHAPES.items():
        copies = max(2, -(-L2_DEFEAT_BYTES // (n * k * (1 if fp8 else 2))))
        weights = [_weight(n, k, fp8, gen) for _ in range(copies)]
        hbm_us = _bytes(weights[0]) / HBM_BYTES_PER_S * 1e6
        x = torch.randn(k, device="cuda", generator=gen).to(torch.bfloat16)
        first = weights[0].dequantize(torch.float32) if fp8 else weights[0].float()
        want = first @ x.float()
        for variant, gemv in gemvs(fp8).items():
            if variant != "skinny partials":  # one K slice is not the product
                _check(variant, gemv(x, weights[0]), want)

            def step(i: int, gemv=gemv, weights=weights, x=x) -> None:
                gemv(x, weights[i % len(weights)])

            _print(shape, variant, graph_time_us(step, 2 * len(weights)), hbm_us)


def layer_chain(fp8: bool, layers: int, gen: torch.Generator) -> None:
    """qkv -> o -> gate_up -> down over distinct layers; checks each variant's last output
    against the finished skinny kernel's (relative error of the whole vector)."""
    stack = [[(_weight(n, k, fp8, gen), k) for n, k in SHAPES.values()] for _ in range(layers)]
    hbm_us = sum(_bytes(w) for w, _ in stack[0]) / HBM_BYTES_PER_S * 1e6
    start = torch.randn(2048, device="cuda", generator=gen).to(torch.bfloat16)
    want = None
    for variant, gemv in gemvs(fp8).items():
        if variant == "skinny partials":  # its slices are not a layer's input
            continue

        def layer(i: int, gemv=gemv) -> torch.Tensor:
            x = start
            for weight, k in stack[i % layers]:
                x = gemv(x[:k], weight)  # the leading part of the previous output
            return x

        out = layer(0)
        if want is None:
            want = out
        else:
            _check(variant, out, want)
        _print(f"layer x{layers}", variant, graph_time_us(layer, layers), hbm_us)


def main() -> None:
    parser = CLIParser(prog="python -m benchmarks.probe_register_gemv", description=__doc__)
    parser.add_argument("--fp8", action="store_true", help="float8 weights, a scale per row")
    parser.add_argument("--layers", type=int, default=8, help="distinct layers in the chain")
    args = parser.parse_args()
    parser.require_cuda()
    gen = torch.Generator("cuda").manual_seed(0)
    shape_chains(args.fp8, gen)
    layer_chain(args.fp8, args.layers, gen)


if __name__ == "__main__":
    main()
