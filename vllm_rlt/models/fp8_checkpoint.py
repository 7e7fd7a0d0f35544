"""FP8 checkpoints as vLLM reads them: config.json's `quantization_config` with
`quant_method: "fp8"` and dynamic activation scaling, each layer projection's `weight` in
float8 e4m3 beside its `weight_scale` (one per tensor, or one per output channel). The
values and scales are kept as they are, as the engine's Fp8Weight (a tensor's one scale
becomes the scale of each of its rows), so nothing is rounded twice."""

from __future__ import annotations

from typing import Any

import torch

from vllm_rlt.layers.fp8 import FP8_DTYPE, QUANTIZED_PROJECTIONS, Fp8Weight

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


def is_fp8_checkpoint(raw: dict[str, Any]) -> bool:
    """Whether config.json describes an FP8 checkpoint; ValueError naming what this engine
    cannot read."""
    spec = raw.get("quantization_config")
    if spec is None:
        return False
    if not isinstance(spec, dict):
        raise ValueError(f"config.json: quantization_config must be an object, got {spec!r}")
    method = spec.get("quant_method")
    if method != "fp8":
        raise ValueError(
            "config.json: quantization_config.quant_method must be 'fp8' (the only "
            f"checkpoint quantization read), got {method!r}"
        )
    if spec.get("activation_scheme", "dynamic") != "dynamic":
        raise ValueError(
            "config.json: quantization_config.activation_scheme must be 'dynamic' "
            f"(activations are scaled per token as they run), got {spec['activation_scheme']!r}"
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
    projections = [
        layer
        for layer in spec.get("ignored_layers") or ()
        if not str(layer).endswith(("lm_head", "embed_tokens"))
    ]
    if projections:
        raise ValueError(
            "config.json: quantization_config.ignored_layers may name only lm_head and "
            f"embed_tokens (every layer projection is read in float8), got {projections}"
        )
    return True


def _projection_names(shapes: dict[str, tuple[int, ...]]) -> list[str]:
    return [name for name in shapes if name.endswith(PROJECTION_WEIGHTS)]


def scale_names(shapes: dict[str, tuple[int, ...]]) -> dict[str, None]:
    """The weight_scale tensor of every projection (shape checked by `row_scales`)."""
    return {name + "_scale": None for name in _projection_names(shapes)}


def row_scales(scale: torch.Tensor, rows: int, name: str) -> torch.Tensor:
    """[rows] float32 from a tensor's one scale or its per-channel scales."""
    flat = scale.float().reshape(-1)
    if flat.numel() == 1:
        return flat.expand(rows).clone()
    if flat.numel() != rows:
        raise ValueError(
            f"checkpoint tensor {name} holds {flat.numel()} scales for {rows} output channels "
            "(one per tensor or one per channel)"
        )
    return flat.clone()


def split_scales(
    weights: dict[str, torch.Tensor], shapes: dict[str, tuple[int, ...]]
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Take the float8 projections and their scales out of `weights` and put the
    dequantized projections in (the model is built from those); returns the float8 values
    and the [rows] scales, by projection weight name."""
    float8, scales = {}, {}
    for name in _projection_names(shapes):
        data = weights[name]
        if data.dtype != FP8_DTYPE:
            raise ValueError(f"checkpoint tensor {name} must be float8_e4m3fn, got {data.dtype}")
        float8[name] = data
        scales[name] = row_scales(weights.pop(name + "_scale"), data.shape[0], name + "_scale")
        weights[name] = data.float() * scales[name][:, None]
    return float8, scales


def install(model, float8: dict[str, torch.Tensor], scales: dict[str, torch.Tensor]) -> None:
    """Replace the model's projections by the checkpoint's float8 values and scales, fused as
    the model fuses its weights (q/k/v stacked, gate/up interleaved)."""
    device = model.device

    def taker(source: dict[str, torch.Tensor]):
        def take(name: str) -> torch.Tensor:
            # a norm is no projection: it is built and dropped
            # a copy: the model owns its storage (a file-backed one cannot be released)
            return source[name].to(device, copy=True) if name in source else torch.empty(0)

        return take

    for index, layer in enumerate(model.layers):
        prefix = f"model.layers.{index}."
        data = model._load_layer(taker(float8), prefix)
        row = model._load_layer(taker(scales), prefix)
        for attr in QUANTIZED_PROJECTIONS:
            weight = Fp8Weight(getattr(data, attr).contiguous(), getattr(row, attr).contiguous())
            setattr(layer, attr, weight)
    model.quantization = "fp8"
