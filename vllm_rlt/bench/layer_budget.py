"""A decoder layer's budget: each op's HBM bytes and FLOPs, and its time bound on a device."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# The engine's choices the bounds follow (ops/linear_plans.py and ops/triton_ops.py; a
# test reads them there): fp8 weights reach FP8 tensor cores only above FP8_SKINNY_ROWS
# rows (fewer rows widen them to bf16 in registers, so their products count at the bf16
# rate), and decode passes of up to FUSED_DECODE_ROWS rows write K/V and attend in one
# kernel.
FP8_SKINNY_ROWS = 1
FUSED_DECODE_ROWS = 16
ACTIVATION_BYTES = 2  # bf16 activations, norm weights and LM head
WEIGHT_BYTES = {"bf16": 2, "fp8": 1}

QKV, O_PROJ, GATE_UP, DOWN = "qkv", "o", "gate_up + SiLU-mul", "down"
ROPE, ATTENTION = "rope + KV write", "attention"
ROPE_ATTENTION = "rope + KV write + attention"
ATTENTION_NORMS, MLP_NORMS = "add + norms (attention)", "add + norms (MLP)"
INPUT_NORM, LM_HEAD = "input norm", "LM head (every row)"


@dataclass(frozen=True)
class Device:
    """The limits the bounds divide by; the defaults are an H200's as measured there
    (copy bandwidth, dense bf16 tensor-core rate) and twice that rate for FP8."""

    bandwidth: float = 4.3e12  # HBM bytes/s
    bf16_flops: float = 7.9e14  # FLOP/s
    fp8_flops: float = 1.58e15


@dataclass(frozen=True)
class LayerShape:
    """The sizes of a decoder layer and of the model around it."""

    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    layers: int
    vocab: int
    branch_norms: bool = True  # Ouro's sandwich norms: a second norm weight per add

    @classmethod
    def from_config(cls, raw: dict[str, Any], branch_norms: bool = True) -> LayerShape:
        """From config.json's fields."""
        heads, hidden = raw["num_attention_heads"], raw["hidden_size"]
        return cls(
            hidden=hidden,
            intermediate=raw["intermediate_size"],
            heads=heads,
            kv_heads=raw.get("num_key_value_heads") or heads,
            head_dim=raw.get("head_dim") or hidden // heads,
            layers=raw["num_hidden_layers"],
            vocab=raw["vocab_size"],
            branch_norms=branch_norms,
        )


@dataclass(frozen=True)
class Op:
    """What one op must move through HBM and multiply, at least."""

    name: str
    bytes: int
    flops: int = 0
    fp8: bool = False  # products on FP8 tensor cores

    def bytes_us(self, device: Device) -> float:
        return self.bytes / device.bandwidth * 1e6

    def flops_us(self, device: Device) -> float:
        return self.flops / (device.fp8_flops if self.fp8 else device.bf16_flops) * 1e6

    def bound_us(self, device: Device) -> float:
        return max(self.bytes_us(device), self.flops_us(device))

    def limit(self, device: Device) -> str:
        return "bytes" if self.bytes_us(device) >= self.flops_us(device) else "FLOPs"


def _projection(name: str, rows: int, n: int, k: int, out: int, weights: str) -> Op:
    """x [rows, k] @ W.T for W [n, k], writing `out` columns (the SiLU-mul's half for
    gate_up): the weight once (fp8: with its float32 row scales), activations in and out."""
    weight = n * k * WEIGHT_BYTES[weights] + (n * 4 if weights == "fp8" else 0)
    fp8 = weights == "fp8" and rows > FP8_SKINNY_ROWS
    return Op(name, weight + rows * (k + out) * ACTIVATION_BYTES, 2 * rows * n * k, fp8)


def layer_ops(
    shape: LayerShape, rows: int, weights: str = "bf16", kv_bytes: int = 2, context: int = 64
) -> list[Op]:
    """One layer's ops in the order a decode pass of `rows` rows runs them, each row
    attending `context` positions of K/V stored in `kv_bytes`-byte elements and writing its
    own in one plane. Each add + norms op also holds the next norm (the following layer's
    input norm after the MLP), as the engine fuses them; activations count once, as if
    every op were one kernel (a merged RoPE + attention keeps q's round trip). Attention's
    products count at the bf16 rate: one query row a head is far below its bytes anyway."""
    if weights not in WEIGHT_BYTES:
        raise ValueError(f"weights must be one of {', '.join(WEIGHT_BYTES)}, got {weights!r}")
    a, h, inter = ACTIVATION_BYTES, shape.hidden, shape.intermediate
    q_width, kv_width = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    qkv_width = q_width + 2 * kv_width
    # qkv in, rotated q out, the new K and V written
    rope = Op(ROPE, rows * (qkv_width + q_width) * a + rows * 2 * kv_width * kv_bytes)
    attention = Op(
        ATTENTION,
        rows * 2 * q_width * a + rows * context * 2 * kv_width * kv_bytes,
        4 * rows * q_width * context,
    )
    attend = [rope, attention]
    if rows <= FUSED_DECODE_ROWS:
        attend = [Op(ROPE_ATTENTION, rope.bytes + attention.bytes, attention.flops)]
    # x and the branch in, x and its norm out, one or two norm weights
    norms = (2 if shape.branch_norms else 1) * h * a + 4 * rows * h * a
    return [
        _projection(QKV, rows, qkv_width, h, qkv_width, weights),
        *attend,
        _projection(O_PROJ, rows, h, q_width, h, weights),
        Op(ATTENTION_NORMS, norms),
        _projection(GATE_UP, rows, 2 * inter, h, inter, weights),
        _projection(DOWN, rows, h, inter, h, weights),
        Op(MLP_NORMS, norms),
    ]


def pass_ops(shape: LayerShape, rows: int) -> list[Op]:
    """A pass's ops outside its layers that the bounds cover: the first input norm and the
    LM head (in bf16 under fp8 too) as if every row sampled."""
    a, h = ACTIVATION_BYTES, shape.hidden
    return [
        Op(INPUT_NORM, h * a + 2 * rows * h * a),
        _projection(LM_HEAD, rows, shape.vocab, h, shape.vocab, "bf16"),
    ]


def layer_bound_us(ops: list[Op], device: Device) -> float:
    """Each op as one kernel at its limit, one after the other."""
    return sum(op.bound_us(device) for op in ops)
