"""The toy model (`--model toy`): a tiny Ouro with seeded random weights and a byte tokenizer,
for tests and smoke runs; its outputs are noise."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from vllm_rlt.models.ouro import OuroConfig
from vllm_rlt.tokenizer import Tokenizer
from vllm_rlt.tokenizer.byte_level import BYTE_VOCAB_SIZE, ENDOFTEXT_ID, IM_END_ID

TOY_NAME = "toy"
TOY_SEED = 1234


def toy_config_dict() -> dict[str, Any]:
    """config.json of the toy: Ouro architecture, 2 layers, GQA, 4 loops."""
    return {
        "architectures": ["OuroForCausalLM"],
        "model_type": "ouro",
        "vocab_size": BYTE_VOCAB_SIZE,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
        "total_ut_steps": 4,
        "early_exit_threshold": 1.0,
        "bos_token_id": ENDOFTEXT_ID,
        "eos_token_id": [ENDOFTEXT_ID, IM_END_ID],
        "torch_dtype": "float32",
    }


def toy_weights(seed: int = TOY_SEED) -> dict[str, torch.Tensor]:
    """Seeded float32 weights scaled so logits and exit hazards spread widely."""
    config = OuroConfig.from_dict(toy_config_dict())
    generator = torch.Generator().manual_seed(seed)
    weights = {}
    for name, shape in config.checkpoint_shapes().items():
        if name.endswith("norm.weight"):
            tensor = 1.0 + 0.1 * torch.randn(shape, generator=generator)
        elif name == "model.early_exit_gate.bias":
            tensor = torch.zeros(shape)
        elif name == "model.early_exit_gate.weight":
            tensor = torch.randn(shape, generator=generator) * (2.0 / shape[-1] ** 0.5)
        elif name in ("model.embed_tokens.weight",):
            tensor = torch.randn(shape, generator=generator)
        else:
            scale = 3.0 if name == "lm_head.weight" else 1.0
            tensor = torch.randn(shape, generator=generator) * (scale / shape[-1] ** 0.5)
        weights[name] = tensor.float().contiguous()
    return weights


def save_toy_model(folder: str | Path, seed: int = TOY_SEED) -> Path:
    """Write the toy as an ordinary HF folder that the loader reads back."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(toy_config_dict(), indent=2) + "\n")
    save_file(toy_weights(seed), str(folder / "model.safetensors"))
    Tokenizer.byte_level().save_pretrained(folder)
    return folder
