"""Tiny seeded Huginn (RavenForCausalLM) checkpoints for CPU tests.

The folder looks like a Hugging Face Huginn-0125 folder: `config.json` with RavenConfig's
field names and `model.safetensors` with the checkpoint's tensor names and shapes, only
small. Weights are random but seeded, with spreads chosen so that the recurrence neither
dies out nor saturates within a few steps (the state then changes from step to step, which
the exit-criterion tests need).
"""

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

# The tiny shape: Huginn-0125's 2 + 4 + 2 layers, hidden 64, 4 heads of 16, vocabulary 300.
TINY_CONFIG: dict = {
    "architectures": ["RavenForCausalLM"],
    "model_type": "huginn_raven",
    "n_embd": 64,
    "n_heads": 4,
    "num_key_value_heads": 4,
    "n_layers": 8,
    "n_layers_in_prelude": 2,
    "n_layers_in_recurrent_block": 4,
    "n_layers_in_coda": 2,
    "mean_recurrence": 8,
    "mean_backprop_depth": 2,
    "intermediate_size": 96,
    "vocab_size": 300,
    "padded_vocab_size": 300,
    "padding_multiple": 4,
    "block_size": 128,
    "norm_eps": 1e-6,
    "rope_base": 50000.0,
    "qk_bias": True,
    "bias": False,
    "tie_embeddings": True,
    "injection_type": "linear",
    "state_init": "like-init",
    "block_class_name": "SandwichBlock",
    "norm_class_name": "RMSNorm_llama",
    "mlp_class_name": "GatedMLP",
    "nonlin_name": "SiLU",
    "torch_dtype": "float32",
}

_STAGES = (
    ("prelude", "n_layers_in_prelude"),
    ("core_block", "n_layers_in_recurrent_block"),
    ("coda", "n_layers_in_coda"),
)


def huginn_weight_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor name of a Huginn checkpoint and its shape (lm_head.weight included)."""
    hidden = config["n_embd"]
    heads = config["n_heads"]
    head_dim = hidden // heads
    inter = config["intermediate_size"]
    vocab = config["vocab_size"]
    shapes: dict[str, tuple[int, ...]] = {
        "transformer.wte.weight": (vocab, hidden),
        "transformer.adapter.weight": (hidden, 2 * hidden),
        "transformer.ln_f.weight": (hidden,),
        "lm_head.weight": (vocab, hidden),
    }
    if config.get("bias", False):
        shapes["transformer.adapter.bias"] = (hidden,)
    for stage, count_key in _STAGES:
        for i in range(config[count_key]):
            p = f"transformer.{stage}.{i}."
            for norm in ("norm_1", "norm_2", "norm_3", "norm_4"):
                shapes[p + norm + ".weight"] = (hidden,)
            shapes[p + "attn.Wqkv.weight"] = (3 * hidden, hidden)
            if config.get("qk_bias", True):
                shapes[p + "attn.qk_bias"] = (2, 1, heads, head_dim)
            shapes[p + "attn.proj.weight"] = (hidden, hidden)
            shapes[p + "mlp.fc.weight"] = (2 * inter, hidden)
            shapes[p + "mlp.proj.weight"] = (hidden, inter)
    return shapes


def tiny_huginn_weights(config: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    """Seeded float32 weights for `config`; lm_head equals the embedding when tied."""
    gen = torch.Generator().manual_seed(seed)
    weights: dict[str, torch.Tensor] = {}
    for name, shape in huginn_weight_shapes(config).items():
        if name.endswith(("norm_1.weight", "norm_2.weight", "norm_3.weight", "norm_4.weight")):
            tensor = 1.0 + 0.1 * torch.randn(shape, generator=gen)
        elif name == "transformer.ln_f.weight":
            tensor = 1.0 + 0.1 * torch.randn(shape, generator=gen)
        elif name.endswith("qk_bias"):
            tensor = 0.1 * torch.randn(shape, generator=gen)
        elif name == "transformer.wte.weight":
            # scaled by sqrt(n_embd) = 8 on the way in
            tensor = 0.1 * torch.randn(shape, generator=gen)
        else:
            fan_in = shape[-1]
            tensor = torch.randn(shape, generator=gen) / fan_in**0.5
        weights[name] = tensor.contiguous()
    if config.get("tie_embeddings", True):
        weights["lm_head.weight"] = weights["transformer.wte.weight"].clone()
    return weights


# A seed whose tiny checkpoint settles within its 8 steps, so the exit criteria exit early.
TINY_HUGINN_SEED = 5


def write_tiny_huginn(
    folder: Path, seed: int = 0, overrides: dict | None = None, drop_tied_head: bool = False
) -> dict:
    """Write config.json and model.safetensors of a tiny Huginn into `folder`.

    `drop_tied_head` leaves lm_head.weight out (a tied checkpoint may or may not carry it;
    the published one carries both copies). Returns the config written.
    """
    config = dict(TINY_CONFIG)
    config.update(overrides or {})
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    weights = tiny_huginn_weights(config, seed)
    if drop_tied_head and config.get("tie_embeddings", True):
        del weights["lm_head.weight"]
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(weights, str(folder / "model.safetensors"))
    return config
