"""A trainable Ouro (dense, every loop for every token) whose parameter names are the HF
checkpoint names, so `state_dict()` saves straight into a folder the engine loads."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from vllm_rlt.layers.norm import rms_norm
from vllm_rlt.layers.rotary import RotaryEmbedding
from vllm_rlt.models.ouro import OuroConfig


class Norm(nn.Module):
    """RMSNorm with a learned weight, as the engine's norms compute it."""

    def __init__(self, hidden: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class _Attention(nn.Module):
    def __init__(self, cfg: OuroConfig) -> None:
        super().__init__()
        d, h = cfg.head_dim, cfg.hidden_size
        self.q_proj = nn.Linear(h, cfg.num_attention_heads * d, bias=False)
        self.k_proj = nn.Linear(h, cfg.num_key_value_heads * d, bias=False)
        self.v_proj = nn.Linear(h, cfg.num_key_value_heads * d, bias=False)
        self.o_proj = nn.Linear(cfg.num_attention_heads * d, h, bias=False)


class _MLP(nn.Module):
    def __init__(self, cfg: OuroConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)


class _Layer(nn.Module):
    def __init__(self, cfg: OuroConfig) -> None:
        super().__init__()
        eps = cfg.rms_norm_eps
        self.self_attn = _Attention(cfg)
        self.mlp = _MLP(cfg)
        self.input_layernorm = Norm(cfg.hidden_size, eps)
        self.input_layernorm_2 = Norm(cfg.hidden_size, eps)
        self.post_attention_layernorm = Norm(cfg.hidden_size, eps)
        self.post_attention_layernorm_2 = Norm(cfg.hidden_size, eps)


class _Backbone(nn.Module):
    def __init__(self, cfg: OuroConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(_Layer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = Norm(cfg.hidden_size, cfg.rms_norm_eps)
        self.early_exit_gate = nn.Linear(cfg.hidden_size, 1)


class TrainableOuro(nn.Module):
    """forward(ids) -> per-loop logits [T, batch, seq, vocab] and hazards [T, batch, seq]."""

    def __init__(self, cfg: OuroConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = _Backbone(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(
            cfg.head_dim, cfg.rope_theta, cfg.max_position_embeddings, torch.float32, "cpu"
        )

    def _attend(self, layer: _Layer, a: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        b, s, _ = a.shape
        heads, kv_heads, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        attn = layer.self_attn
        q = self.rotary.apply(attn.q_proj(a).reshape(b * s, heads, d), positions)
        k = self.rotary.apply(attn.k_proj(a).reshape(b * s, kv_heads, d), positions)
        q = q.view(b, s, heads, d).transpose(1, 2)
        k = k.view(b, s, kv_heads, d).transpose(1, 2).repeat_interleave(heads // kv_heads, 1)
        v = attn.v_proj(a).view(b, s, kv_heads, d).transpose(1, 2)
        v = v.repeat_interleave(heads // kv_heads, 1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=1 / math.sqrt(d))
        return attn.o_proj(out.transpose(1, 2).reshape(b, s, heads * d))

    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b, s = ids.shape
        self.rotary.cos = self.rotary.cos.to(ids.device)
        self.rotary.sin = self.rotary.sin.to(ids.device)
        positions = torch.arange(s, device=ids.device).repeat(b)
        x = self.model.embed_tokens(ids)
        logits, hazards = [], []
        for _ in range(self.cfg.num_loops):
            for layer in self.model.layers:
                x = x + layer.input_layernorm_2(
                    self._attend(layer, layer.input_layernorm(x), positions)
                )
                mlp = layer.mlp
                hidden = layer.post_attention_layernorm(x)
                x = x + layer.post_attention_layernorm_2(
                    mlp.down_proj(F.silu(mlp.gate_proj(hidden)) * mlp.up_proj(hidden))
                )
            x = self.model.norm(x)
            logits.append(self.lm_head(x))
            hazards.append(torch.sigmoid(self.model.early_exit_gate(x).squeeze(-1)))
        return torch.stack(logits), torch.stack(hazards)


def exit_distribution(hazards: torch.Tensor) -> torch.Tensor:
    """p_t = lambda_t * prod_{s<t}(1 - lambda_s); the last loop takes the remaining mass
    (its own hazard is unused). hazards [T, ...] -> probabilities [T, ...] summing to 1."""
    survival = torch.cumprod(1 - hazards, dim=0)
    before = torch.cat([torch.ones_like(survival[:1]), survival[:-1]])
    probs = hazards * before
    return torch.cat([probs[:-1], before[-1:]], dim=0)
