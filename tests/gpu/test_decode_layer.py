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
def test_one_launch_equals_the_chain(parts, kind, kv_heads, rows, context):
    """Contexts of 1, a block (16), a block and one, and one row at 8,192 beside short ones;
    every second row writing the planes above its own too; grouped heads (kv_heads 1)."""
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
    assert errors["x_out"] < 1e-2 and errors["a_out"] < 2e-2, errors


def test_ouro_shapes_and_repeated_launches_leave_the_counters_free(parts):
    """Ouro-1.4B's layer at 16 rows, launched many times over one counter ring's turn: every
    launch equal to the first (a counter left raised would let a unit run early)."""
    from benchmarks.probe_decode_layer import build_cache, build_weights, fused_layer
    from vllm_rlt.kernels import decode_layer

    ops, rotary = parts
    weights = build_weights("bf16", 0)
    x = torch.randn(16, 2048, device="cuda").to(torch.bfloat16)
    a = ops.rms_norm(x, weights.mlp_norm, 1e-6)
    k_cache, v_cache, meta = build_cache(16, [80] * 16, 16, 0)
    first = None
    for _ in range(decode_layer.RING + 3):
        out = fused_layer(
            x, a, weights, weights.mlp_norm, k_cache, v_cache, meta, rotary, 16, 0.088
        )
        first = first or tuple(t.clone() for t in out)
    torch.cuda.synchronize()
    assert all(torch.equal(t, f) for t, f in zip(out, first, strict=True))
    ring, _ = decode_layer._counters[x.device]
    assert int(ring.count_nonzero()) == 0
