"""Named model shapes with random weights, made directly on the target device."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the names alone (for --shape) must not load torch
    import torch


def _toy_shape() -> dict:
    from vllm_rlt.models.toy import toy_config_dict

    return toy_config_dict()


def _ouro_shape(layers: int) -> dict:
    return {
        "model_type": "ouro",
        "vocab_size": 49152,
        "hidden_size": 2048,
        "intermediate_size": 5632,
        "num_hidden_layers": layers,
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
        "head_dim": 128,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "max_position_embeddings": 65536,
        "total_ut_steps": 4,
        "eos_token_id": 0,
    }


def _nanbeige_shape() -> dict:
    """Nanbeige4.2-3B, as its public config.json gives it."""
    return {
        "model_type": "nanbeige",
        "vocab_size": 166144,
        "hidden_size": 3072,
        "intermediate_size": 10752,
        "num_hidden_layers": 22,
        "num_attention_heads": 48,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "rms_norm_eps": 1e-5,
        "rope_theta": 70000000.0,
        "max_position_embeddings": 262144,
        "num_loops": 2,
        "eos_token_id": 166101,
    }


def _huginn_shape() -> dict:
    """Huginn-0125 (3.5B), as its public config.json gives it."""
    return {
        "model_type": "huginn_raven",
        "architectures": ["RavenForCausalLM"],
        "n_embd": 5280,
        "n_heads": 55,
        "num_key_value_heads": 55,
        "n_layers": 8,
        "n_layers_in_prelude": 2,
        "n_layers_in_recurrent_block": 4,
        "n_layers_in_coda": 2,
        "mean_recurrence": 32,
        "intermediate_size": 17920,
        "vocab_size": 65536,
        "padded_vocab_size": 65536,
        "block_size": 4096,
        "norm_eps": 1e-6,
        "rope_base": 50000,
        "qk_bias": True,
        "bias": False,
        "tie_embeddings": True,
        "eos_token_id": 65505,
    }


def _huginn_toy_shape() -> dict:
    """Huginn's outline at the toy's size (head size 24, 8 steps): bench paths on a CPU."""
    shape = _huginn_shape()
    shape.update(n_embd=96, n_heads=4, num_key_value_heads=4, intermediate_size=192)
    shape.update(vocab_size=512, padded_vocab_size=512, mean_recurrence=8, eos_token_id=0)
    return shape


SHAPES = {
    "toy": _toy_shape,
    "huginn-toy": _huginn_toy_shape,
    "ouro-1.4b": lambda: _ouro_shape(24),
    "ouro-2.6b": lambda: _ouro_shape(48),
    "nanbeige-4.2-3b": _nanbeige_shape,
    "huginn-3.5b": _huginn_shape,
}


def random_model(shape: str, dtype: torch.dtype, device: torch.device, seed: int = 0):
    """A model of the named shape with seeded random weights scaled like the toy's."""

    from vllm_rlt.models.registry import resolve_family

    if shape not in SHAPES:
        raise ValueError(f"shape must be one of {', '.join(SHAPES)}, got {shape!r}")
    raw = SHAPES[shape]()
    config_class, model_class = resolve_family(raw)
    config = config_class.from_dict(raw)
    weights = random_weights(config, dtype, device, seed)
    model = model_class(config, weights, dtype, device)
    del weights
    return model


def random_weights(config, dtype: torch.dtype, device: torch.device, seed: int) -> dict:
    """Seeded checkpoint tensors: unit norm weights, a zero gate bias, the rest
    N(0, 1/fan_in)."""
    import torch

    generator = torch.Generator(device=device).manual_seed(seed)
    weights = {}
    for name, size in config.checkpoint_shapes().items():
        if name.endswith(("norm.weight", "ln_f.weight")) or ".norm_" in name:  # Huginn's
            tensor = torch.ones(size, device=device, dtype=dtype)
        elif name == "model.early_exit_gate.bias":
            tensor = torch.zeros(size, device=device, dtype=dtype)
        else:
            tensor = torch.randn(size, generator=generator, device=device, dtype=torch.float32)
            tensor = (tensor * (1.0 / size[-1] ** 0.5)).to(dtype)
        weights[name] = tensor
    return weights


def save_random_checkpoint(
    shape: str, folder: str, dtype: torch.dtype, device: torch.device, seed: int = 0
) -> None:
    """A checkpoint folder (config.json, model.safetensors) of the named shape with the
    weights `random_model` would make, for benchmarks that load a model by path (a server)."""
    import json
    from pathlib import Path

    from safetensors.torch import save_file

    from vllm_rlt.models.registry import resolve_family

    raw = SHAPES[shape]()
    config = resolve_family(raw)[0].from_dict(raw)
    weights = random_weights(config, dtype, device, seed)
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    save_file(
        {name: t.cpu().contiguous() for name, t in weights.items()}, str(out / "model.safetensors")
    )
    (out / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
