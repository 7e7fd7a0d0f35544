"""FP8 checkpoints as vLLM reads them: config.json's `quantization_config` with
`quant_method: "fp8"`, each layer projection's `weight` in float8 e4m3 beside its
`weight_scale` (one per tensor, or one per output channel). The values and scales are kept
as they are, as the engine's Fp8Weight (a tensor's one scale becomes the scale of each of
its rows), so nothing is rounded twice.

Optional, as vLLM reads them:
- K/V cache scales, `self_attn.k_scale` and `self_attn.v_scale` (or `k_proj.output_scale`
  and `v_proj.output_scale`), one per tensor or one per KV head: a float8 KV cache then
  holds K / k_scale and V / v_scale. They are unused under a KV cache in the model's dtype.
- Static activation scales (`activation_scheme: "static"`, each projection's
  `input_scale`): checked and left unused, since activations are scaled per token as they
  run, which rounds no coarser than one scale per tensor."""

from __future__ import annotations

from typing import Any

import torch

from vllm_rlt.layers.fp8 import FP8_DTYPE, is_float8
from vllm_rlt.models.hf_config import shown

# The checkpoint tensors of one layer that an FP8 checkpoint stores in float8.
PROJECTION_WEIGHTS = tuple(
    f"{part}.weight"
    for part in (
        "self_attn.q_proj",
        "self_attn.k_proj",
        "self_attn.v_proj",
        "self_attn.o_proj",
        "mlp.gate_proj",
        "mlp.up_proj",
        "mlp.down_proj",
    )
)
_KNOWN_KEYS = {"quant_method", "activation_scheme", "weight_block_size", "ignored_layers"}
ACTIVATION_SCHEMES = ("dynamic", "static")
# A layer's K/V cache scales under the names vLLM reads: (K, V) pairs, newest first.
KV_SCALE_NAMES = (
    ("self_attn.k_scale", "self_attn.v_scale"),
    ("self_attn.k_proj.output_scale", "self_attn.v_proj.output_scale"),
)


def is_fp8_checkpoint(raw: dict[str, Any]) -> bool:
    """Whether config.json describes an FP8 checkpoint; ValueError naming what this engine
    cannot read."""
    spec = raw.get("quantization_config")
    if spec is None:
        return False
    if not isinstance(spec, dict):
        raise ValueError(f"config.json: quantization_config must be an object, got {shown(spec)}")
    method = spec.get("quant_method")
    if method != "fp8":
        raise ValueError(
            "config.json: quantization_config.quant_method must be 'fp8' (the only "
            f"checkpoint quantization read), got {shown(method)}"
        )
    scheme = spec.get("activation_scheme", "dynamic")
    if scheme not in ACTIVATION_SCHEMES:
        raise ValueError(
            "config.json: quantization_config.activation_scheme must be 'dynamic' or 'static' "
            f"(activations are scaled per token as they run), got {shown(scheme)}"
        )
    if spec.get("weight_block_size") is not None:
        raise ValueError(
            "config.json: quantization_config.weight_block_size is not supported "
            "(weight scales per tensor or per output channel only)"
        )
    unknown = sorted(set(spec) - _KNOWN_KEYS)
    if unknown:
        raise ValueError(f"config.json: unsupported quantization_config keys: {unknown}")
    # The LM head (and embedding) stay unquantized here anyway; a layer projection left in
    # the model's dtype would split a fused weight between two formats.
    ignored = spec.get("ignored_layers") or []
    if not isinstance(ignored, list):
        raise ValueError(
            "config.json: quantization_config.ignored_layers must be a list of layer names, "
            f"got {type(ignored).__name__}"
        )
    projections = [
        layer for layer in ignored if not str(layer).endswith(("lm_head", "embed_tokens"))
    ]
    if projections:
        raise ValueError(
            "config.json: quantization_config.ignored_layers may name only lm_head and "
            f"embed_tokens (every layer projection is read in float8), got {shown(projections)}"
        )
    return True


def _projection_names(shapes: dict[str, tuple[int, ...]]) -> list[str]:
    return [name for name in shapes if name.endswith(PROJECTION_WEIGHTS)]


def scale_names(shapes: dict[str, tuple[int, ...]]) -> dict[str, None]:
    """The weight_scale tensor of every projection (shape checked by `row_scales`)."""
    return {name + "_scale": None for name in _projection_names(shapes)}


def optional_names(shapes: dict[str, tuple[int, ...]], num_layers: int) -> set[str]:
    """Tensors an FP8 checkpoint may hold beside its weights: every projection's static
    input_scale and every layer's K/V cache scales."""
    names = {name.removesuffix("weight") + "input_scale" for name in _projection_names(shapes)}
    for layer in range(num_layers):
        names.update(f"model.layers.{layer}.{n}" for pair in KV_SCALE_NAMES for n in pair)
    return names


def _positive(tensor: torch.Tensor, name: str) -> torch.Tensor:
    values = tensor.float().reshape(-1)
    if not bool(torch.isfinite(values).all()) or not bool((values > 0).all()):
        raise ValueError(f"checkpoint tensor {name} must hold finite scales > 0")
    return values


def pop_activation_scales(weights: dict[str, torch.Tensor]) -> None:
    """Check and drop static input scales (activations are scaled per token instead)."""
    for name in [n for n in weights if n.endswith(".input_scale")]:
        values = _positive(weights.pop(name), name)
        if values.numel() != 1:
            raise ValueError(f"checkpoint tensor {name} must hold one scale, got {values.numel()}")


def pop_kv_scales(
    weights: dict[str, torch.Tensor], num_layers: int, kv_heads: int
) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
    """Every layer's (K, V) cache scales as [kv_heads] float32 (a tensor's one scale for
    each head), taken out of `weights`; None when the checkpoint has none. A layer may not
    hold one without the other, nor some layers without the rest."""
    found = []
    for layer in range(num_layers):
        prefix = f"model.layers.{layer}."
        pairs = [(prefix + k, prefix + v) for k, v in KV_SCALE_NAMES]
        present = [pair for pair in pairs if pair[0] in weights or pair[1] in weights]
        if len(present) > 1:
            raise ValueError(f"checkpoint holds K/V scales of layer {layer} under two names")
        if not present:
            found.append(None)
            continue
        k_name, v_name = present[0]
        if k_name not in weights or v_name not in weights:
            raise ValueError(f"checkpoint holds only one of {k_name} and {v_name}")
        found.append(tuple(_head_scales(weights.pop(n), kv_heads, n) for n in (k_name, v_name)))
    if all(pair is None for pair in found):
        return None
    if any(pair is None for pair in found):
        missing = [layer for layer, pair in enumerate(found) if pair is None]
        raise ValueError(f"checkpoint lacks K/V scales of layers {missing[:8]} (others have them)")
    return found


def _head_scales(tensor: torch.Tensor, kv_heads: int, name: str) -> torch.Tensor:
    return _one_or_each(_positive(tensor, name), kv_heads, name, "KV head")


def row_scales(scale: torch.Tensor, rows: int, name: str) -> torch.Tensor:
    """[rows] float32 from a tensor's one scale or its per-channel scales."""
    return _one_or_each(scale.float().reshape(-1), rows, name, "output channel")


def _one_or_each(values: torch.Tensor, count: int, name: str, part: str) -> torch.Tensor:
    """[count] scales from one scale for all parts or one scale for each."""
    if values.numel() == 1:
        return values.expand(count).clone()
    if values.numel() != count:
        raise ValueError(
            f"checkpoint tensor {name} holds {values.numel()} scales for {count} {part}s "
            f"(one per tensor or one per {part})"
        )
    return values.clone()


def split_scales(
    weights: dict[str, torch.Tensor], shapes: dict[str, tuple[int, ...]]
) -> dict[str, torch.Tensor]:
    """Check the float8 projections and take their scales out of `weights`, as [rows]
    float32 by projection weight name. The projections stay float8: the model fuses them
    as they are."""
    projections = set(_projection_names(shapes))
    stray = sorted(n for n, t in weights.items() if is_float8(t) and n not in projections)
    if stray:
        raise ValueError(f"checkpoint tensors {stray[:4]} are float8 (only projections may be)")
    scales = {}
    for name in projections:
        data = weights[name]
        if data.dtype != FP8_DTYPE:
            raise ValueError(f"checkpoint tensor {name} must be float8_e4m3fn, got {data.dtype}")
        scales[name] = row_scales(weights.pop(name + "_scale"), data.shape[0], name + "_scale")
    return scales
