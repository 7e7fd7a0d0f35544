"""Nanbeige4.2: a plain pre-norm Llama stack run a fixed number of loops, with the final
norm at the end of every loop and no exit gate."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import torch

from vllm_rlt.models.hf_config import (
    COMMON_HARMLESS_KEYS,
    MAX_LOOPS,
    config_int,
    llama_fields,
    llama_layer_shapes,
    shown,
)
from vllm_rlt.models.ouro import OuroModel

_HARMLESS_KEYS = COMMON_HARMLESS_KEYS | {
    "pretraining_tp",
    "kv_channels",
    "attention_bias",
    "mlp_bias",
    "skip_loop_final_norm",
    "loop_loss_weights",
}
# Variants the checkpoint family can switch on; none is implemented, so each is refused.
_UNSUPPORTED_FLAGS = (
    "qk_layernorm",
    "enable_double_loop_split",
    "loop_middle_layers",
    "loop_share_kv",
    "enable_hyper_connection",
    "enable_mhc",
    "enable_depth_attention",
    "emb_neighbor_num",
    "emb_split_num",
    "ngram_vocab_size_ratio",
    "insert_ngram_layer_idx",
)


@dataclass(frozen=True)
class NanbeigeConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    num_loops: int
    tie_word_embeddings: bool = False
    eos_token_ids: tuple[int, ...] = ()
    exit_threshold: float = 1.0  # no gate: fixed depth unless a request asks otherwise

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> NanbeigeConfig:
        known = {f.name for f in fields(cls)} - {"eos_token_ids", "exit_threshold"}
        unknown = sorted(set(raw) - known - _HARMLESS_KEYS - set(_UNSUPPORTED_FLAGS))
        if unknown:
            raise ValueError(f"config.json: unsupported Nanbeige config keys: {', '.join(unknown)}")
        enabled = [flag for flag in _UNSUPPORTED_FLAGS if raw.get(flag)]
        if enabled:
            raise ValueError(f"config.json: unsupported Nanbeige variants: {', '.join(enabled)}")
        if raw.get("hidden_act", "silu") != "silu":
            raise ValueError(
                f"config.json: hidden_act must be 'silu', got {shown(raw['hidden_act'])}"
            )
        for flag in ("attention_bias", "mlp_bias", "skip_loop_final_norm"):
            if raw.get(flag):
                raise ValueError(f"config.json: {flag}=true is not supported")
        if raw.get("loop_loss_weights"):
            raise ValueError(
                "config.json: loop_loss_weights (training-only extra loops) must be []"
            )
        if raw.get("rope_scaling") not in (None, {}):
            raise ValueError("config.json: rope_scaling is not supported")
        return cls(
            **llama_fields(raw, 1e-5, 4096, ("head_dim", "kv_channels")),
            num_loops=config_int(raw, "num_loops", 1, MAX_LOOPS, default=2),
        )

    def kv_planes(self, planes: int) -> tuple[int, ...]:
        """Every layer loops: each keeps `planes`."""
        return (planes,) * self.num_hidden_layers

    def checkpoint_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor of an HF Nanbeige checkpoint: plain Llama names, nothing per loop."""
        return llama_layer_shapes(self, branch_norms=False)


class NanbeigeModel(OuroModel):
    """The Ouro stages with plain pre-norm layers (no branch norms) and no gate."""

    def _load_gate(self, take) -> None:
        self.gate_weight = self.gate_bias = None

    branch_norms = False

    def gate(self, hidden: torch.Tensor) -> torch.Tensor:
        """No gate in the checkpoint: a zero hazard, so only thresholds of 0 or max_loops
        end a token before the full depth."""
        return torch.full(
            (hidden.shape[0],), float("-inf"), dtype=torch.float32, device=hidden.device
        )
