"""One decoder layer in one launch (kernels/decode_layer.py) against the chain of Triton
kernels it would replace, and against that chain with the few-row CUDA products, at
Ouro-1.4B's shapes: 24 layers with weights and K/V caches of their own (so weights come from
HBM, not L2), every row at --context positions, bf16 and float8 weights. Each layer's
outputs and K/V writes are first checked against the few-row CUDA products around a
float32 attention (the same products and K/V, bit for bit); then each variant runs as CUDA
graphs of the 24 layers. Prints microseconds per layer against the weight bytes over the
copy bandwidth measured first. Needs a GPU of sm_90 on.

python -m benchmarks.probe_decode_layer --rows 1 2 4 8 16 --context 80 --output probe.json

With --timeline, each block of the one launch also stamps the GPU clock at the end of each
phase, and the probe prints what each phase adds to the launch's critical path against its
weight bytes over the bandwidth.
"""

from __future__ import annotations

import json
import math
import statistics
import sys

import torch

from benchmarks.probe_few_row_gemm import copy_bandwidth
from vllm_rlt.cli_parser import CLIParser

LAYERS = 24
# Ouro-1.4B's layer
HIDDEN, HEADS, KV_HEADS, INTER, EPS, THETA = 2048, 16, 16, 5632, 1e-6, 10000.0
PLANES, BLOCK_SIZE = 4, 16


def build_weights(kind: str, seed: int, hidden=HIDDEN, heads=HEADS, kv_heads=KV_HEADS, inter=INTER):
    """A random sandwich layer: bf16 products (or their float8 form) and norms near 1."""
    from vllm_rlt.kernels.decode_layer import HEAD_DIM, SandwichWeights
    from vllm_rlt.layers.fp8 import Fp8Weight

    gen = torch.Generator(device="cuda").manual_seed(seed)

    def product(n: int, k: int):
        w = (torch.randn(n, k, device="cuda", generator=gen) / math.sqrt(k)).to(torch.bfloat16)
        return Fp8Weight.quantize(w) if kind == "fp8" else w

    def norm():
        return (1 + 0.1 * torch.randn(hidden, device="cuda", generator=gen)).to(torch.bfloat16)

    width = (heads + 2 * kv_heads) * HEAD_DIM
    return SandwichWeights(
        qkv=product(width, hidden),
        o=product(hidden, hidden),
        gate_up=product(2 * inter, hidden),
        down=product(hidden, inter),
        attn_out_norm=norm(),
        mlp_norm=norm(),
        mlp_out_norm=norm(),
    )


def build_cache(
    rows: int, contexts: list[int], kv_heads: int, seed: int, multi_plane=False, device="cuda"
):
    """(k_cache, v_cache, metadata): row r at position contexts[r] - 1 of its own shuffled
    blocks, reading plane r % PLANES, writing it (and, with multi_plane, every plane above it
    for odd rows, as a token that exits early fills the loops it skips). The metadata holds
    segments too, for torch's attention."""
    from vllm_rlt.kernels.decode_layer import HEAD_DIM
    from vllm_rlt.ops.metadata import PAD_KEY_POSITION, AttentionMetadata, Segments

    gen = torch.Generator(device=device).manual_seed(seed)
    per_row = -(-max(contexts) // BLOCK_SIZE)
    slots = rows * per_row * BLOCK_SIZE + BLOCK_SIZE  # and a spare block
    order = torch.randperm(rows * per_row, device=device, generator=gen)
    table = order.reshape(rows, per_row).to(torch.int64)
    shape = (PLANES * slots, kv_heads, HEAD_DIM)
    k_cache = torch.randn(shape, device=device, generator=gen).to(torch.bfloat16)
    v_cache = torch.randn(shape, device=device, generator=gen).to(torch.bfloat16)
    positions = torch.tensor([c - 1 for c in contexts], device=device, dtype=torch.int64)
    plane = torch.arange(rows, device=device, dtype=torch.int64) % PLANES
    hi = plane + 1
    if multi_plane:
        hi = torch.where(plane % 2 == 1, torch.full_like(plane, PLANES), hi)
    rows_range = torch.arange(rows, device=device)
    entry = table[rows_range, positions // BLOCK_SIZE] * BLOCK_SIZE + positions % BLOCK_SIZE
    keys = torch.arange(per_row * BLOCK_SIZE, device=device)
    key_slots = table[:, keys // BLOCK_SIZE] * BLOCK_SIZE + keys % BLOCK_SIZE
    segments = Segments(
        rows=rows_range.to(torch.int64)[:, None],
        q_pos=positions[:, None],
        kv_index=plane[:, None] * slots + key_slots,
        kv_pos=torch.where(keys[None, :] <= positions[:, None], keys[None, :], PAD_KEY_POSITION),
    )
    meta = AttentionMetadata(
        positions=positions,
        row_tables=rows_range.to(torch.int64),
        read_plane=plane,
        write_lo=plane,
        write_hi=hi,
        row_entry=entry,
        block_table=table,
        planes=PLANES,
        slots_per_plane=slots,
        block_size=BLOCK_SIZE,
        dummy_entry=slots - 1,
        num_decode=rows,
        rows_independent=True,
        segments=segments,
    )
    return k_cache, v_cache, meta


def chain_layer(ops, x, a, weights, next_norm, k_cache, v_cache, meta, rotary, heads, scale):
    """The layer as the engine runs it today (models/ouro.py's core, one layer)."""
    kv_heads = k_cache.shape[1]
    qkv = ops.linear(a, weights.qkv)
    attn = ops.attention(qkv, heads, kv_heads, k_cache, v_cache, meta, rotary, scale)
    x, b = ops.linear_add_rms_norm2(
        x, attn, weights.o, weights.attn_out_norm, weights.mlp_norm, EPS
    )
    mlp = ops.linear_silu_mul(b, weights.gate_up)
    return ops.linear_add_rms_norm2(x, mlp, weights.down, weights.mlp_out_norm, next_norm, EPS)


def cuda_chain_layer(ops, x, a, weights, next_norm, k_cache, v_cache, meta, rotary, heads, scale):
    """The same with the few-row CUDA products (kernels/few_row_gemm.py), which compute
    each output as the one-launch kernel does (same tiles, same K split, same rounding).
    With `ops` a ReferenceAttention, the K/V written are the kernel's bits and only
    attention's summation order differs from it."""
    from vllm_rlt.kernels.few_row_gemm import few_row_gemm, few_row_gemm_add_norms

    kv_heads = k_cache.shape[1]
    qkv = few_row_gemm(a, weights.qkv)
    attn = ops.attention(qkv, heads, kv_heads, k_cache, v_cache, meta, rotary, scale)
    x, b = few_row_gemm_add_norms(x, attn, weights.o, weights.attn_out_norm, weights.mlp_norm, EPS)
    mlp = few_row_gemm(b, weights.gate_up, silu_mul=True)
    return few_row_gemm_add_norms(x, mlp, weights.down, weights.mlp_out_norm, next_norm, EPS)


class ReferenceAttention:
    """RoPE and the K/V writes by torch (ops/torch_ops.py), whose RoPE rounds each product
    as the kernel's does (the Triton kernel's may round its sums once: a last-bit difference
    in some K elements), then attention in float32 as the kernel's (torch's bf16 attention
    rounds the probabilities to bf16)."""

    def attention(self, qkv, heads, kv_heads, k_cache, v_cache, meta, rotary, scale):
        from vllm_rlt.ops.torch_ops import TorchOps

        TorchOps().attention(qkv, heads, kv_heads, k_cache, v_cache, meta, rotary, scale)
        rows, dim = qkv.shape[0], k_cache.shape[-1]
        q = rotary.apply(qkv[:, : heads * dim].reshape(rows, heads, dim), meta.positions)
        segments = meta.segments  # one a row, as build_cache makes them
        group = heads // kv_heads
        keys = k_cache[segments.kv_index].float().repeat_interleave(group, dim=2)
        values = v_cache[segments.kv_index].float().repeat_interleave(group, dim=2)
        scores = torch.einsum("rhd,rkhd->rhk", q.float(), keys) * scale
        future = (segments.kv_pos > segments.q_pos)[:, None, :]
        weights = scores.masked_fill(future, -math.inf).softmax(-1)
        return torch.einsum("rhk,rkhd->rhd", weights, values).to(qkv.dtype).reshape(rows, -1)


def fused_layer(
    ops, x, a, weights, next_norm, k_cache, v_cache, meta, rotary, heads, scale, grid=None,
    trace=None,
):  # fmt: skip
    from vllm_rlt.kernels.decode_layer import decode_layer

    return decode_layer(
        x,
        a,
        weights,
        next_norm,
        k_cache,
        v_cache,
        meta,
        rotary.cos,
        rotary.sin,
        heads,
        EPS,
        scale,
        grid=grid,
        trace=trace,
    )


VARIANTS = {"chain": chain_layer, "cuda chain": cuda_chain_layer, "fused": fused_layer}


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm())


def same_kv(cache: torch.Tensor, reference: torch.Tensor, meta) -> bool:
    """Whether two caches hold the same bits outside each plane's dummy slot (torch's
    attention sends a row's writes to the planes it does not own there; no row reads it)."""
    keep = torch.ones(cache.shape[0], dtype=torch.bool, device=cache.device)
    keep[meta.dummy_entry :: meta.slots_per_plane] = False
    return torch.equal(cache[keep], reference[keep])


def check_layer(
    ops, rows, contexts, kind, rotary, seed=0, multi_plane=True, grid=None, **shape
) -> dict:
    """One layer by the kernel and by the CUDA products around ReferenceAttention, on
    copies of one cache: the outputs' relative errors, and whether the K/V each wrote are
    the same bits."""
    heads = shape.get("heads", HEADS)
    weights = build_weights(kind, seed, **shape)
    hidden = weights.o.shape[0]
    gen = torch.Generator(device="cuda").manual_seed(seed + 1)
    x = torch.randn(rows, hidden, device="cuda", generator=gen).to(torch.bfloat16)
    a = ops.rms_norm(x, weights.mlp_norm, EPS)
    kv_heads = shape.get("kv_heads", KV_HEADS)
    k_cache, v_cache, meta = build_cache(rows, contexts, kv_heads, seed, multi_plane)
    scale = 1 / math.sqrt(128)
    copies = (k_cache.clone(), v_cache.clone())
    args = (x, a, weights, weights.mlp_norm)
    want = cuda_chain_layer(ReferenceAttention(), *args, *copies, meta, rotary, heads, scale)
    got = fused_layer(ops, *args, k_cache, v_cache, meta, rotary, heads, scale, grid=grid)
    torch.cuda.synchronize()
    return {
        "x_out": relative_error(got[0], want[0]),
        "a_out": relative_error(got[1], want[1]),
        "kv_equal": same_kv(k_cache, copies[0], meta) and same_kv(v_cache, copies[1], meta),
    }


def phase_timeline(
    layers, caches, x0, a0, rotary, scale, rounds=3
) -> tuple[dict[str, float], dict[str, float]]:
    """(microseconds each phase of the one launch adds to its critical path, from the last
    block's end of the phase before to the last block's end of this one; microseconds from
    the first block's start to each step inside the phases, at the last block to reach it):
    medians over rounds x 24 traced launches, each run alone (decode_layer's `trace`)."""
    from vllm_rlt.kernels.decode_layer import PHASES, STEPS, TRACE_SLOTS, decode_layer

    blocks = torch.cuda.get_device_properties(x0.device).multi_processor_count
    trace = torch.zeros(blocks, TRACE_SLOTS, dtype=torch.int64, device=x0.device)
    marks: dict[str, list[float]] = {name: [] for name in (*PHASES[1:], *STEPS)}
    for _ in range(rounds):
        for weights, (k_cache, v_cache, meta) in zip(layers, caches, strict=True):
            trace.zero_()  # a norm step is stamped by one block alone
            decode_layer(
                x0, a0, weights, weights.mlp_norm, k_cache, v_cache, meta, rotary.cos,
                rotary.sin, HEADS, EPS, scale, trace=trace,
            )  # fmt: skip
            stamps = trace.cpu()
            start = int(stamps[:, 0].min())
            for i, name in enumerate((*PHASES[1:], *STEPS), start=1):
                marks[name].append((int(stamps[:, i].max()) - start) / 1e3)
    timeline, previous = {}, 0.0
    for phase in PHASES[1:]:
        end = statistics.median(marks[phase])
        timeline[phase], previous = end - previous, end
    return timeline, {step: statistics.median(marks[step]) for step in STEPS}


def phase_floors(weights, bandwidth: float) -> dict[str, float]:
    """Each phase's weight bytes over the bandwidth, in microseconds (attention: none)."""
    phases = ("qkv", "o and norms", "gate_up", "down and norms")
    floors = {"attention": 0.0}
    for phase, weight in zip(phases, weights.products(), strict=True):
        data = getattr(weight, "data", weight)
        floors[phase] = data.numel() * data.element_size() / bandwidth * 1e6
    return floors


def main(argv: list[str] | None = None) -> int:
    parser = CLIParser(prog="python -m benchmarks.probe_decode_layer", description=__doc__)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16], help="rows a pass")
    parser.add_argument("--context", type=int, default=80, help="positions each row attends")
    parser.add_argument("--output", default=None, help="JSON of every figure (default: none)")
    parser.add_argument(
        "--timeline",
        action="store_true",
        help="also time the one launch's phases from per-block clock stamps, against each "
        "phase's weight bytes (default: off)",
    )
    args = parser.parse_args(argv)
    parser.require_cuda()
    import triton.testing

    from vllm_rlt.layers.rotary import RotaryEmbedding
    from vllm_rlt.ops.triton_ops import TritonOps

    bandwidth = copy_bandwidth()
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s", file=sys.stderr)
    ops = TritonOps()
    rotary = RotaryEmbedding(128, THETA, args.context + 1, torch.bfloat16, "cuda")
    report = {"bandwidth": bandwidth, "device": torch.cuda.get_device_name(), "cases": []}
    scale = 1 / math.sqrt(128)
    for kind in ("bf16", "fp8"):
        layers = [build_weights(kind, seed) for seed in range(LAYERS)]
        weight_bytes = sum(
            w.numel() * (1 if kind == "fp8" else 2)
            for w in (p.data if kind == "fp8" else p for p in layers[0].products())
        )
        for rows in args.rows:
            errors = check_layer(ops, rows, [args.context] * rows, kind, rotary)
            assert errors["kv_equal"], f"{kind} rows {rows}: the K/V written differ"
            assert errors["x_out"] < 5e-3 and errors["a_out"] < 1e-2, f"{kind} {rows}: {errors}"
            caches = [
                build_cache(rows, [args.context] * rows, KV_HEADS, seed) for seed in range(LAYERS)
            ]
            x0 = torch.randn(rows, HIDDEN, device="cuda").to(torch.bfloat16)
            a0 = ops.rms_norm(x0, layers[0].mlp_norm, EPS)
            figures = {"kind": kind, "rows": rows, "context": args.context, **errors}
            for name, layer_fn in VARIANTS.items():

                def run(layer_fn=layer_fn, caches=caches, layers=layers, x0=x0, a0=a0):
                    x, a = x0, a0
                    for weights, (k_cache, v_cache, meta) in zip(layers, caches, strict=True):
                        x, a = layer_fn(
                            ops,
                            x,
                            a,
                            weights,
                            weights.mlp_norm,
                            k_cache,
                            v_cache,
                            meta,
                            rotary,
                            HEADS,
                            scale,
                        )

                run()  # compiles, and takes the counters before the capture
                ms = triton.testing.do_bench_cudagraph(run, rep=100, return_mode="median")
                figures[f"{name}_us_per_layer"] = ms * 1e3 / LAYERS
            floor = weight_bytes / bandwidth * 1e6
            figures["bytes_floor_us"] = floor
            report["cases"].append(figures)
            fused = figures["fused_us_per_layer"]
            print(
                f"{kind} rows {rows:2d}: chain {figures['chain_us_per_layer']:6.2f}, cuda chain "
                f"{figures['cuda chain_us_per_layer']:6.2f}, fused {fused:6.2f} us a layer "
                f"(weights' floor {floor:5.2f}: {floor / fused:.2f} of it fused); errors x "
                f"{errors['x_out']:.1e} a {errors['a_out']:.1e}"
            )
            if args.timeline:
                timeline, steps = phase_timeline(layers, caches, x0, a0, rotary, scale)
                floors = phase_floors(layers[0], bandwidth)
                figures["phase_us"], figures["phase_floor_us"] = timeline, floors
                figures["step_us_from_start"] = steps
                print(
                    "  by phase: "
                    + " | ".join(
                        f"{p} {us:.1f} (floor {floors[p]:.1f})" for p, us in timeline.items()
                    )
                    + f" | total {sum(timeline.values()):.1f} us"
                )
                print("  steps, us from the start: " + " | ".join(
                    f"{step} {us:.1f}" for step, us in steps.items()
                ))  # fmt: skip
    if args.output:
        with open(args.output, "w") as out:
            json.dump(report, out, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
