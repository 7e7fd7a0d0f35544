"""The one-launch decoder layer (kernels/decode_layer.py) against the chain of Triton kernels
it replaces: the layer's output stream and its next norm, and the K/V bits it writes."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

SMALL = dict(hidden=256, heads=2, inter=512)  # head size 128, as the kernel takes it


def _module_or_skip():
    from vllm_rlt.kernels import decode_layer

    if decode_layer._module(torch.device("cuda")) is None:
        pytest.skip("needs sm_90 and nvcc")


@pytest.fixture(scope="module")
def parts():
    _module_or_skip()
    from vllm_rlt.layers.rotary import RotaryEmbedding
    from vllm_rlt.ops.triton_ops import TritonOps

    return TritonOps(), RotaryEmbedding(128, 10000.0, 8192, torch.bfloat16, "cuda")


@pytest.mark.parametrize("kind", ["bf16", "fp8"])
@pytest.mark.parametrize("kv_heads", [2, 1])
@pytest.mark.parametrize("rows", [1, 3, 8, 9, 16])
@pytest.mark.parametrize("context", ["one", "block", "block+1", "long"])
def test_one_launch_equals_the_cuda_chain(parts, kind, kv_heads, rows, context):
    """Contexts of 1, a block (16), a block and one, and one row at 8,192 beside short ones;
    every second row writing the planes above its own too; grouped heads (kv_heads 1). The
    reference computes the same products with the few-row kernels, so the K/V written must
    be the same bits and the outputs differ only by attention's summation order (the
    reference's RoPE rounds as the kernel's does, and it attends in float32)."""
    from benchmarks.probe_decode_layer import check_layer

    ops, rotary = parts
    contexts = {
        "one": [1] * rows,
        "block": [16] * rows,
        "block+1": [17] * rows,
        "long": [8192] + [5 + 7 * i for i in range(rows - 1)],
    }[context]
    errors = check_layer(ops, rows, contexts, kind, rotary, kv_heads=kv_heads, **SMALL)
    assert errors["kv_equal"]
    assert errors["x_out"] < 5e-3 and errors["a_out"] < 1e-2, errors


@pytest.mark.parametrize("grid", [1, 2, 7])
@pytest.mark.parametrize("rows", [3, 16])
def test_blocks_that_take_several_units_each(parts, grid, rows):
    """Fewer blocks than units: a block runs tiles, attention pairs and norms one after
    another, reusing its shared memory, and counts several units (one block: every phase
    on one block, which must not wait on itself)."""
    from benchmarks.probe_decode_layer import check_layer

    ops, rotary = parts
    errors = check_layer(ops, rows, [40] * rows, "bf16", rotary, grid=grid, kv_heads=1, **SMALL)
    assert errors["kv_equal"]
    assert errors["x_out"] < 5e-3 and errors["a_out"] < 1e-2, errors


@pytest.mark.parametrize("kind", ["bf16", "fp8"])
@pytest.mark.parametrize("rows", [1, 16])
def test_ouro_shapes(parts, kind, rows):
    """Ouro-1.4B's layer: more qkv and gate_up tiles than blocks, hidden 2,048."""
    from benchmarks.probe_decode_layer import check_layer

    ops, rotary = parts
    errors = check_layer(ops, rows, [80] * rows, kind, rotary)
    assert errors["kv_equal"]
    assert errors["x_out"] < 5e-3 and errors["a_out"] < 1e-2, errors


def test_counters_are_left_free_for_the_next_launches(parts):
    """More launches than the counter ring holds, each on new rows: each equal to the CUDA
    chain on the same inputs and cache (a counter left raised would let a unit run early
    and read stale scratch), and the ring all zero at the end."""
    from benchmarks.probe_decode_layer import (
        ReferenceAttention,
        build_cache,
        build_weights,
        cuda_chain_layer,
        fused_layer,
        relative_error,
        same_kv,
    )
    from vllm_rlt.kernels import decode_layer

    ops, rotary = parts
    weights = build_weights("bf16", 0, kv_heads=2, **SMALL)
    k_cache, v_cache, meta = build_cache(4, [30, 1, 17, 64], 2, 0)
    gen = torch.Generator(device="cuda").manual_seed(3)
    for launch in range(decode_layer.RING + 3):
        x = torch.randn(4, 256, device="cuda", generator=gen).to(torch.bfloat16)
        a = ops.rms_norm(x, weights.mlp_norm, 1e-6)
        args = (ops, x, a, weights, weights.mlp_norm)
        checked = launch % 100 == 0 or launch >= decode_layer.RING
        if checked:
            copies = (k_cache.clone(), v_cache.clone())
            want = cuda_chain_layer(ReferenceAttention(), *args[1:], *copies, meta, rotary, 2, 0.1)
        got = fused_layer(*args, k_cache, v_cache, meta, rotary, 2, 0.1)
        if checked:
            assert relative_error(got[0], want[0]) < 5e-3, launch
            assert same_kv(k_cache, copies[0], meta) and same_kv(v_cache, copies[1], meta)
    torch.cuda.synchronize()
    ring = decode_layer.COUNTERS.counters(x.device)
    assert int(ring.count_nonzero()) == 0


def test_a_traced_launch_stamps_every_phase_and_changes_nothing(parts):
    """With `trace`, each block writes its start and each phase's end, in order, and the
    layer's outputs and K/V are the bits of an untraced launch."""
    from benchmarks.probe_decode_layer import build_cache, build_weights, fused_layer
    from vllm_rlt.kernels.decode_layer import PHASES, STEPS, TRACE_SLOTS

    ops, rotary = parts
    weights = build_weights("bf16", 0, kv_heads=2, **SMALL)
    k_cache, v_cache, meta = build_cache(3, [30, 1, 17], 2, 0)
    x = torch.randn(3, 256, device="cuda").to(torch.bfloat16)
    a = ops.rms_norm(x, weights.mlp_norm, 1e-6)
    copies = (k_cache.clone(), v_cache.clone())
    args = (ops, x, a, weights, weights.mlp_norm)
    want = fused_layer(*args, *copies, meta, rotary, 2, 0.1, grid=7)
    trace = torch.zeros(7, TRACE_SLOTS, dtype=torch.int64, device="cuda")
    got = fused_layer(*args, k_cache, v_cache, meta, rotary, 2, 0.1, grid=7, trace=trace)
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    assert torch.equal(k_cache, copies[0]) and torch.equal(v_cache, copies[1])
    stamps = trace[:, : len(PHASES)].cpu()
    assert bool((stamps > 0).all()) and bool((stamps.diff(dim=1) >= 0).all())
    # Each step is stamped by at least one block, between its phase's neighbours.
    steps = trace[:, len(PHASES) : len(PHASES) + len(STEPS)].cpu().max(dim=0).values
    o_end, gate_up, down_end = (int(stamps[:, i].max()) for i in (3, 4, 5))
    o_in, o_norms, b_staged, down_in, down_norms = (int(t) for t in steps)
    assert int(stamps[:, 1].min()) <= o_in <= o_norms <= o_end
    assert o_norms <= b_staged <= gate_up and b_staged <= down_in <= down_norms <= down_end
