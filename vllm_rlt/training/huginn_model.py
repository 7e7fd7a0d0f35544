"""A trainable Huginn-shaped model (prelude, recurrent block, coda) whose parameter names are
the Huginn checkpoint names, so `state_dict()` saves straight into a folder the engine loads
as `RavenForCausalLM`.

Training follows the Huginn recipe at toy scale: each step draws its number of recurrences
from a Poisson log-normal around the mean (so the model answers at many depths, and its
state settles as it converges, which the latent exit criterion reads), and backpropagates
through the last few recurrences only; the first state is noise, as at inference.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from vllm_rlt.layers.rotary import RotaryEmbedding
from vllm_rlt.models.huginn import half_split_columns
from vllm_rlt.models.huginn_config import HuginnConfig
from vllm_rlt.training.model import Norm


class _Attention(nn.Module):
    def __init__(self, cfg: HuginnConfig) -> None:
        super().__init__()
        h, heads = cfg.hidden_size, cfg.num_attention_heads
        self.Wqkv = nn.Linear(h, 3 * h, bias=False)
        self.qk_bias = nn.Parameter(torch.zeros(2, 1, heads, cfg.head_dim))
        self.proj = nn.Linear(h, h, bias=False)


class _MLP(nn.Module):
    def __init__(self, cfg: HuginnConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)


class _Sandwich(nn.Module):
    """x = norm_2(x + proj(attn(norm_1(x)))), x = norm_4(x + mlp(norm_3(x)))."""

    def __init__(self, cfg: HuginnConfig) -> None:
        super().__init__()
        self.attn = _Attention(cfg)
        self.mlp = _MLP(cfg)
        for i in range(1, 5):
            setattr(self, f"norm_{i}", Norm(cfg.hidden_size, cfg.rms_norm_eps))


class _Transformer(nn.Module):
    def __init__(self, cfg: HuginnConfig) -> None:
        super().__init__()
        self.wte = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.prelude = nn.ModuleList(_Sandwich(cfg) for _ in range(cfg.num_prelude_layers))
        self.adapter = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.core_block = nn.ModuleList(_Sandwich(cfg) for _ in range(cfg.num_core_layers))
        self.coda = nn.ModuleList(_Sandwich(cfg) for _ in range(cfg.num_coda_layers))
        self.ln_f = Norm(cfg.hidden_size, cfg.rms_norm_eps)


class TrainableHuginn(nn.Module):
    """`forward(ids)` -> logits after each of 1..num_loops recurrences [T, batch, seq,
    vocab] and no gate (None), as `train.exact_match` reads a model (`noise=False`: from a
    zero state, as a checkpoint with init_scale 0 runs); `final_logits(ids, steps,
    backprop)` for training. The LM head is the embedding (tied)."""

    def __init__(self, cfg: HuginnConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.transformer = _Transformer(cfg)
        self.rotary = RotaryEmbedding(
            cfg.head_dim, cfg.rope_theta, cfg.max_position_embeddings, torch.float32, "cpu"
        )
        self.register_buffer(
            "columns",
            half_split_columns(cfg.num_attention_heads, cfg.head_dim, "cpu"),
            persistent=False,
        )
        # Huginn's "like-init": every matrix, the embedding included, at std sqrt(2 / 5h)
        # (the embedding is scaled by sqrt(h) on the way in, and is the head).
        std = math.sqrt(2 / (5 * cfg.hidden_size))
        for parameter in self.parameters():
            if parameter.dim() == 2:
                nn.init.trunc_normal_(parameter, std=std, a=-3 * std, b=3 * std)

    def _layer(self, layer: _Sandwich, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        b, s, h = x.shape
        heads, d = cfg.num_attention_heads, cfg.head_dim
        attn = layer.attn
        qkv = attn.Wqkv(layer.norm_1(x))
        qk = qkv[..., : 2 * h] + attn.qk_bias.reshape(-1)
        qkv = torch.cat([qk, qkv[..., 2 * h :]], dim=-1)[..., self.columns]
        q, k, v = qkv.reshape(b * s, 3, heads, d).unbind(1)
        q = self.rotary.apply(q, positions).view(b, s, heads, d).transpose(1, 2)
        k = self.rotary.apply(k, positions).view(b, s, heads, d).transpose(1, 2)
        v = v.reshape(b, s, heads, d).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=1 / math.sqrt(d))
        x = layer.norm_2(x + attn.proj(out.transpose(1, 2).reshape(b, s, h)))
        gate, up = layer.mlp.fc(layer.norm_3(x)).chunk(2, dim=-1)
        return layer.norm_4(x + layer.mlp.proj(F.silu(gate) * up))

    def _prelude(
        self, ids: torch.Tensor, noise: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(the prelude's output, the first state: drawn from noise, or zeros, the
        positions)."""
        cfg, t = self.cfg, self.transformer
        self.rotary.cos = self.rotary.cos.to(ids.device)
        self.rotary.sin = self.rotary.sin.to(ids.device)
        b, s = ids.shape
        positions = torch.arange(s, device=ids.device).repeat(b)
        x = t.wte(ids) * cfg.embed_scale
        for layer in t.prelude:
            x = self._layer(layer, x, positions)
        state = torch.zeros(b, s, cfg.hidden_size, device=ids.device)
        if noise:
            state = torch.randn_like(state).clamp(-3.0, 3.0) * (cfg.state_std * cfg.embed_scale)
        return x, state, positions

    def _recur(self, state, injected, positions) -> torch.Tensor:
        x = self.transformer.adapter(torch.cat([state, injected], dim=-1))
        for layer in self.transformer.core_block:
            x = self._layer(layer, x, positions)
        return x

    def _head(self, state: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        t = self.transformer
        x = t.ln_f(state)
        for layer in t.coda:
            x = self._layer(layer, x, positions)
        return F.linear(t.ln_f(x), t.wte.weight)

    def final_logits(self, ids: torch.Tensor, steps: int, backprop: int) -> torch.Tensor:
        """Logits [batch, seq, vocab] after `steps` recurrences, gradients flowing through
        the last `backprop` of them (and the prelude, through the injection)."""
        injected, state, positions = self._prelude(ids)
        with torch.no_grad():
            for _ in range(max(steps - backprop, 0)):
                state = self._recur(state, injected, positions)
        for _ in range(min(backprop, steps)):
            state = self._recur(state, injected, positions)
        return self._head(state, positions)

    def forward(self, ids: torch.Tensor, noise: bool = True) -> tuple[torch.Tensor, None]:
        injected, state, positions = self._prelude(ids, noise)
        logits = []
        for _ in range(self.cfg.num_loops):
            state = self._recur(state, injected, positions)
            logits.append(self._head(state, positions))
        return torch.stack(logits), None


def sample_recurrence(mean: int, generator: torch.Generator, sigma: float = 0.5) -> int:
    """A step's recurrences: 1 + Poisson(exp(tau)), tau ~ N(log(mean - 1) - sigma^2 / 2,
    sigma) (Huginn's Poisson log-normal, whose mean is `mean`), at most 2 * mean."""
    tau = torch.randn((), generator=generator) * sigma + math.log(max(mean - 1, 1)) - sigma**2 / 2
    draw = torch.poisson(tau.exp().reshape(1), generator=generator)
    return int(min(1 + draw.item(), 2 * mean))
