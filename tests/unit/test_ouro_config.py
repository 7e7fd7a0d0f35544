"""The Ouro config parser and tensor list match the published 1.4B / 2.6B checkpoints."""

from __future__ import annotations

import math

import pytest
import torch

from vllm_rlt.models.loader import model_bytes
from vllm_rlt.models.ouro import OuroConfig


def _ouro_config_json(layers: int) -> dict:
    """config.json as the public Ouro checkpoints ship it."""
    return {
        "architectures": ["OuroForCausalLM"],
        "auto_map": {
            "AutoConfig": "configuration_ouro.OuroConfig",
            "AutoModel": "modeling_ouro.OuroModel",
            "AutoModelForCausalLM": "modeling_ouro.OuroForCausalLM",
        },
        "model_type": "ouro",
        "vocab_size": 49152,
        "hidden_size": 2048,
        "intermediate_size": 5632,
        "num_hidden_layers": layers,
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
        "head_dim": 128,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "rope_scaling": None,
        "max_position_embeddings": 65536,
        "tie_word_embeddings": False,
        "total_ut_steps": 4,
        "early_exit_threshold": 1.0,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": layers,
        "layer_types": ["full_attention"] * layers,
        "initializer_range": 0.02,
        "attention_dropout": 0.0,
        "bos_token_id": 0,
        "eos_token_id": 0,
        "pad_token_id": 0,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.55.0",
        "use_cache": True,
    }


@pytest.mark.parametrize(
    ("layers", "params"), [(24, 1_434_652_673), (48, 2_667_974_657)], ids=["1.4b", "2.6b"]
)
def test_published_configs_parse_with_exact_parameter_count(layers, params):
    config = OuroConfig.from_dict(_ouro_config_json(layers))
    shapes = config.checkpoint_shapes()
    assert sum(math.prod(shape) for shape in shapes.values()) == params
    assert len(shapes) == 5 + 11 * layers
    assert config.num_loops == 4 and config.head_dim == 128
    assert config.eos_token_ids == (0,)


def test_head_dim_defaults_to_hidden_over_heads():
    raw = _ouro_config_json(24)
    del raw["head_dim"]
    assert OuroConfig.from_dict(raw).head_dim == 128


@pytest.mark.parametrize(
    ("layers", "params"), [(24, 1_434_652_673), (48, 2_667_974_657)], ids=["1.4b", "2.6b"]
)
def test_size_check_counts_every_weight_and_the_rotary_tables(layers, params):
    """The bytes a config is refused on are counted from one layer's shapes: exactly the
    published parameters, plus the cos and sin tables of every position."""
    config = OuroConfig.from_dict(_ouro_config_json(layers))
    rotary = 2 * 65536 * 128
    assert model_bytes(config, torch.bfloat16, fp8=False) == 2 * (params + rotary)


def test_exit_threshold_is_read_from_the_checkpoint_key():
    """Checkpoints name it early_exit_threshold; the engine's name is exit_threshold, which
    is no key of the file."""
    raw = _ouro_config_json(24) | {"early_exit_threshold": 0.375}
    assert OuroConfig.from_dict(raw).exit_threshold == 0.375
    raw["exit_threshold"] = 0.5
    with pytest.raises(ValueError, match="unsupported Ouro config keys: exit_threshold"):
        OuroConfig.from_dict(raw)
