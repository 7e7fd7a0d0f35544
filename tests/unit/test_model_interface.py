"""The model interface (models/interface.py): every family keeps it, and the sharding and
quantization the engine asks of a model split and store its layers as before."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from vllm_rlt.config import ParamError
from vllm_rlt.layers.fp8 import Fp8Weight
from vllm_rlt.models.interface import LoopedConfig, LoopedModel, RankGroup
from vllm_rlt.models.nanbeige import NanbeigeConfig, NanbeigeModel
from vllm_rlt.models.ouro import OuroConfig, OuroModel
from vllm_rlt.models.ouro_layer import PROJECTIONS
from vllm_rlt.models.toy import toy_config_dict, toy_weights
from vllm_rlt.ops.torch_ops import TorchOps
from vllm_rlt.parallel.tensor_parallel import TensorParallel

NANBEIGE = {
    "model_type": "nanbeige",
    "vocab_size": 300,
    "hidden_size": 48,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_loops": 2,
    "num_attention_heads": 6,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 512,
}


@dataclass
class OneRank:
    """A rank's place in a group whose other ranks are out of the picture."""

    rank: int
    world: int

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor


def _toy() -> OuroModel:
    return OuroModel(OuroConfig.from_dict(toy_config_dict()), toy_weights(), torch.float32, "cpu")


def _nanbeige() -> NanbeigeModel:
    config = NanbeigeConfig.from_dict(NANBEIGE)
    gen = torch.Generator().manual_seed(0)
    weights = {
        name: torch.randn(shape, generator=gen)
        for name, shape in config.checkpoint_shapes().items()
    }
    return NanbeigeModel(config, weights, torch.float32, "cpu")


@pytest.mark.parametrize("build", [_toy, _nanbeige])
def test_every_family_keeps_the_model_interface(build):
    model = build()
    assert isinstance(model, LoopedModel) and isinstance(model.config, LoopedConfig)
    assert model.tensor_parallel is None and model.quantization is None


def test_the_tensor_parallel_group_is_what_a_model_shards_with():
    assert isinstance(TensorParallel(0, 2, None, None), RankGroup)


def test_quantize_leaves_the_weights_without_a_kind_and_refuses_an_unknown_one():
    model = _toy()
    model.quantize(None)
    assert model.quantization is None
    assert not any(isinstance(w, Fp8Weight) for w in model.checkpoint_views().values())
    with pytest.raises(ParamError, match="quantization"):
        model.quantize("int4")
    model.quantize("fp8")
    assert model.quantization == "fp8"
    for layer in model.layers:
        assert all(isinstance(getattr(layer, name), Fp8Weight) for name in PROJECTIONS)


@pytest.mark.parametrize("quantization", [None, "fp8"])
def test_the_ranks_shares_of_a_row_parallel_product_add_up_to_it(quantization):
    """o and down keep a rank's input columns: each rank's product of its share of the
    heads (or features) summed over ranks is the whole product, as the all-reduce makes it."""
    whole = _toy()
    whole.quantize(quantization)
    shards = []
    for rank in range(2):
        shard = _toy()
        shard.quantize(quantization)
        shard.shard(OneRank(rank, 2))
        shards.append(shard)
    cfg = whole.config
    assert shards[0].config.num_attention_heads == cfg.num_attention_heads // 2
    assert shards[0].config.intermediate_size == cfg.intermediate_size // 2
    assert shards[1].tensor_parallel == OneRank(1, 2)
    ops, gen = TorchOps(), torch.Generator().manual_seed(0)
    for name, width in (
        ("o", cfg.num_attention_heads * cfg.head_dim),
        ("down", cfg.intermediate_size),
    ):
        x = torch.randn(3, width, generator=gen)
        want = ops.linear(x, getattr(whole.layers[0], name))
        parts = [
            ops.linear(part, getattr(shard.layers[0], name))
            for part, shard in zip(x.chunk(2, dim=1), shards, strict=True)
        ]
        torch.testing.assert_close(parts[0] + parts[1], want, rtol=1e-5, atol=1e-5)
