"""One physical layer of the Ouro family (Nanbeige and the toy too): its fused weights, and
how they split over tensor-parallel ranks and quantize to fp8, which the model
(models/ouro.py) asks of each layer when the engine asks it (models/interface.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_rlt.layers.fp8 import FP8_DTYPE, Fp8Weight, cat_weight_rows, weight_columns
from vllm_rlt.models.interface import LoopedConfig

# The layer's projections (the GEMMs fp8 quantizes), by attribute name.
PROJECTIONS = ("qkv", "o", "gate_up", "down")


@dataclass
class OuroLayerWeights:
    """One physical layer, with q/k/v and gate/up fused into single GEMMs at load time."""

    qkv: torch.Tensor | Fp8Weight  # [(heads + 2 * kv_heads) * head_dim, hidden]
    o: torch.Tensor | Fp8Weight  # [hidden, heads * head_dim]
    # [2 * intermediate, hidden]: rows gate_0, up_0, gate_1, up_1, ...
    gate_up: torch.Tensor | Fp8Weight
    down: torch.Tensor | Fp8Weight  # [hidden, intermediate]
    attn_norm: torch.Tensor  # [hidden] input_layernorm (pre-attention)
    attn_out_norm: torch.Tensor | None  # [hidden] input_layernorm_2 (on the attention branch)
    mlp_norm: torch.Tensor  # [hidden] post_attention_layernorm (pre-MLP)
    mlp_out_norm: torch.Tensor | None  # [hidden] post_attention_layernorm_2 (on the MLP branch)
    # K and V scales [kv_heads] float32 of a float8 KV cache (an FP8 checkpoint's k_scale,
    # v_scale): the cache holds K / k_scale; None: scale 1
    kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None

    def quantize(self) -> None:
        """Store each projection as an Fp8Weight quantized from its values (one that is
        already an Fp8Weight stays as it is)."""
        for name in PROJECTIONS:
            weight = getattr(self, name)
            if not isinstance(weight, Fp8Weight):
                setattr(self, name, Fp8Weight.quantize(weight))

    def pair_scales(self, scales: OuroLayerWeights) -> None:
        """Make each projection, built from a float8 checkpoint's bytes (held as uint8), an
        Fp8Weight with the matching row scales of `scales` (fused the same way)."""
        for name in PROJECTIONS:
            data = getattr(self, name).view(FP8_DTYPE)
            setattr(self, name, Fp8Weight(data, getattr(scales, name).contiguous()))

    def shard(self, rank: int, world: int, config: LoopedConfig) -> None:
        """Keep rank `rank` of `world`'s share of this layer of the unsplit `config` (in
        place): its heads' rows of q, k and v and its features' rows of gate/up
        (column-parallel), the matching columns of o and down (row-parallel), and its KV
        heads' cache scales."""
        dim = config.head_dim
        heads, kv_heads = config.num_attention_heads // world, config.num_key_value_heads // world
        inter = config.intermediate_size // world
        q_rows, kv_rows = config.num_attention_heads * dim, config.num_key_value_heads * dim
        # this rank's rows of q, k and v within the fused qkv weight
        starts = (
            rank * heads * dim,
            q_rows + rank * kv_heads * dim,
            q_rows + kv_rows + rank * kv_heads * dim,
        )
        counts = (heads * dim, kv_heads * dim, kv_heads * dim)
        self.qkv = cat_weight_rows(
            [self.qkv[s : s + n] for s, n in zip(starts, counts, strict=True)]
        )
        self.o = weight_columns(self.o, rank * heads * dim, (rank + 1) * heads * dim)
        # gate/up rows interleave gate_j, up_j: a rank's features are one block of rows
        self.gate_up = cat_weight_rows([self.gate_up[2 * rank * inter : 2 * (rank + 1) * inter]])
        self.down = weight_columns(self.down, rank * inter, (rank + 1) * inter)
        if self.kv_scales is not None:  # per KV head: this rank's heads
            heads_here = slice(rank * kv_heads, (rank + 1) * kv_heads)
            self.kv_scales = tuple(scale[heads_here].contiguous() for scale in self.kv_scales)
