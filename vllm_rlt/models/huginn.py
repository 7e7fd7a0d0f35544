"""Huginn-0125 (`RavenForCausalLM`): a prelude run once per token, a recurrent block looped
from a drawn initial state with the prelude's output injected at every loop, and a coda run
on the state a token exits with.

One loop of a pass (`step`) takes every row, at any mix of loops, through the prelude at
its first loop and one loop of the block on the row's K/V plane. A row carries its state
and the prelude's output (the input injection the adapter reads at every loop), so later
loops skip the prelude: its weights stream only for row tiles with a row at its first loop,
and only those rows write its K/V. Once the pass knows which rows exit, `readout` runs the
coda on them alone, writing its K/V at the loop the token exits at (the only loop whose
coda K/V a later position reads). Prelude and coda layers keep one K/V plane, the block one
per loop (`HuginnConfig.kv_planes`).

The maths (the public `raven_modeling_minimal.py`): SandwichBlock layers,
x = norm_2(x + proj(attn(norm_1(x)))), x = norm_4(x + mlp(norm_3(x))); a fused Wqkv with
a per-head bias on q and k before RoPE on interleaved pairs; a gated SiLU MLP whose fc
gives [gate | up]; embeddings times sqrt(n_embd); the adapter over concat(state, prelude
output) at the start of every loop; ln_f before the coda and again before the head.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from vllm_rlt.config import ParamError
from vllm_rlt.layers.initial_state import truncated_normal
from vllm_rlt.layers.norm import rms_norm
from vllm_rlt.layers.rotary import RotaryEmbedding
from vllm_rlt.models.huginn_config import HuginnConfig
from vllm_rlt.models.interface import RankGroup, StepInputs
from vllm_rlt.ops.base import LoopOps
from vllm_rlt.ops.metadata import AttentionMetadata


def _state_kernel():
    """kernels/truncated_normal.py's launcher, or None without Triton."""
    try:
        from vllm_rlt.kernels.truncated_normal import truncated_normal_cuda
    except ImportError:
        return None
    return truncated_normal_cuda


@dataclass
class SandwichLayer:
    """One attention layer's weights, as the checkpoint stores them (so weight updates
    copy into them in place)."""

    qkv: torch.Tensor  # [3 * hidden, hidden] Wqkv: q, k, v rows, RoPE pairs interleaved
    qk_bias: torch.Tensor | None  # [2, 1, heads, head_dim]: added to q and k before RoPE
    proj: torch.Tensor  # [hidden, hidden]
    fc: torch.Tensor  # [2 * inter, hidden]: gate rows, then up rows
    down: torch.Tensor  # [hidden, inter] mlp.proj
    norms: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]  # norm_1 .. norm_4


def half_split_columns(heads: int, dim: int, device) -> torch.Tensor:
    """Column order [3 * heads * dim] that turns each q and k head's interleaved RoPE pairs
    (2i, 2i + 1) into the rotate-half layout (i, i + dim / 2) the attention ops rotate; v
    keeps its order. q.k is the same in either order."""
    within = torch.cat([torch.arange(0, dim, 2), torch.arange(1, dim, 2)])  # [dim]
    heads_q_k = (torch.arange(2 * heads).unsqueeze(1) * dim + within).flatten()
    v = torch.arange(2 * heads * dim, 3 * heads * dim)
    return torch.cat([heads_q_k, v]).to(device)


class HuginnModel:
    """Huginn weights and one loop of a pass over packed rows (see the module docstring)."""

    separate_readout = True
    exit_policy = "latent_diff"  # ExitConfig mode "auto"; exit_threshold 0: fixed depth
    quantization: str | None = None
    tensor_parallel: RankGroup | None = None

    def __init__(
        self, config: HuginnConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype, device
    ) -> None:
        self.config = config
        self.dtype = dtype
        self.device = torch.device(device)
        # Each token starts from noise drawn per (seed, position), unless init_scale is 0.
        self.draws_initial_state = config.init_scale > 0

        def take(name: str) -> torch.Tensor:
            return weights[name].to(device=self.device, dtype=dtype, copy=True).contiguous()

        self.embed = take("transformer.wte.weight")  # [vocab, hidden]
        self.lm_head = (
            self.embed if config.tie_word_embeddings else take("lm_head.weight")
        )  # [vocab, hidden]
        self.ln_f = take("transformer.ln_f.weight")  # [hidden]
        self.adapter = take("transformer.adapter.weight")  # [hidden, 2 * hidden]
        self.adapter_bias = take("transformer.adapter.bias") if config.adapter_bias else None
        self.layers = [
            SandwichLayer(
                qkv=take(p + "attn.Wqkv.weight"),
                qk_bias=take(p + "attn.qk_bias") if config.qk_bias else None,
                proj=take(p + "attn.proj.weight"),
                fc=take(p + "mlp.fc.weight"),
                down=take(p + "mlp.proj.weight"),
                norms=tuple(take(f"{p}norm_{i}.weight") for i in range(1, 5)),
            )
            for p in config.layer_prefixes()
        ]
        self.rotary = RotaryEmbedding(
            config.head_dim, config.rope_theta, config.max_position_embeddings, dtype, self.device
        )
        self.columns = half_split_columns(config.num_attention_heads, config.head_dim, self.device)
        self.scale = 1.0 / math.sqrt(config.head_dim)

    # -- what the engine asks of a model (models/interface.py) --------------------------

    def shard(self, group: RankGroup) -> None:
        raise ParamError(
            "tensor parallelism is not implemented for Huginn models yet: use "
            "tensor_parallel_size 1",
            "tensor_parallel_size",
        )

    def quantize(self, kind: str | None) -> None:
        if kind is not None:
            raise ParamError(
                f"quantization {kind!r} is not implemented for Huginn models yet: leave "
                "quantization unset",
                "quantization",
            )

    @property
    def carried_width(self) -> int:
        """The state, then the prelude's output."""
        return 2 * self.config.hidden_size

    def streamed_bytes(self) -> tuple[int, int, int, int]:
        """A token needs the adapter and the block every loop, the prelude, the coda and
        the LM head once."""
        cfg = self.config

        def nbytes(tensors) -> int:
            return sum(t.numel() * t.element_size() for t in tensors)

        core = range(cfg.num_prelude_layers, cfg.num_prelude_layers + cfg.num_core_layers)
        looped, once = nbytes([self.adapter]), nbytes([self.lm_head])
        for index, layer in enumerate(self.layers):
            weights = nbytes((layer.qkv, layer.proj, layer.fc, layer.down))
            if index in core:
                looped += weights
            else:
                once += weights
        return looped, once, cfg.num_core_layers, cfg.num_prelude_layers + cfg.num_coda_layers

    def checkpoint_views(self) -> dict[str, torch.Tensor]:
        """Every checkpoint tensor name and the model tensor holding it (stored as the
        checkpoint stores it)."""
        views = {
            "transformer.wte.weight": self.embed,
            "transformer.ln_f.weight": self.ln_f,
            "transformer.adapter.weight": self.adapter,
        }
        if self.adapter_bias is not None:
            views["transformer.adapter.bias"] = self.adapter_bias
        if not self.config.tie_word_embeddings:
            views["lm_head.weight"] = self.lm_head
        for prefix, layer in zip(self.config.layer_prefixes(), self.layers, strict=True):
            views[prefix + "attn.Wqkv.weight"] = layer.qkv
            if layer.qk_bias is not None:
                views[prefix + "attn.qk_bias"] = layer.qk_bias
            views[prefix + "attn.proj.weight"] = layer.proj
            views[prefix + "mlp.fc.weight"] = layer.fc
            views[prefix + "mlp.proj.weight"] = layer.down
            for index, norm in enumerate(layer.norms, start=1):
                views[f"{prefix}norm_{index}.weight"] = norm
        return views

    def initial_state(self, seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The state [rows, hidden] a token at each position starts its first loop from:
        a truncated normal drawn per (request seed, position) (layers/initial_state.py),
        exact zeros at init_scale 0."""
        cfg = self.config
        shape = (positions.shape[0], cfg.hidden_size)
        if cfg.init_scale == 0:
            return torch.zeros(shape, dtype=self.dtype, device=positions.device)
        args = (seeds, positions, cfg.hidden_size, cfg.state_std, cfg.embed_scale, self.dtype)
        if seeds.is_cuda and (kernel := _state_kernel()) is not None:
            return kernel(*args)  # one kernel instead of some 50 (kernels/truncated_normal.py)
        return truncated_normal(*args)

    def step(
        self,
        rows: StepInputs,
        meta: AttentionMetadata,
        k_caches: list[torch.Tensor],
        v_caches: list[torch.Tensor],
        ops: LoopOps,
    ) -> torch.Tensor:
        """[rows, 2 * hidden]: the state after this loop, then the prelude's output (run
        for rows at their first loop, carried by the others)."""
        cfg, hidden = self.config, self.config.hidden_size
        first = rows.loops == 0
        prelude = first & meta.writing  # a held-back row keeps its injection
        if rows.padding is not None:
            prelude &= ~rows.padding
        injected = self.embed[rows.tokens] * cfg.embed_scale
        once = meta.single_plane(writes=prelude)
        for i in range(cfg.num_prelude_layers):
            injected = self._layer(ops, injected, i, k_caches[i], v_caches[i], once, prelude)
        first = first.unsqueeze(1)
        injected = torch.where(first, injected, rows.carried[:, hidden:])
        start = self.initial_state(rows.seeds, meta.positions)
        state = torch.where(first, start, rows.carried[:, :hidden])
        x = ops.linear(torch.cat([state, injected], dim=1), self.adapter)
        if self.adapter_bias is not None:
            x = x + self.adapter_bias
        core = range(cfg.num_prelude_layers, cfg.num_prelude_layers + cfg.num_core_layers)
        for i in core:
            x = self._layer(ops, x, i, k_caches[i], v_caches[i], meta)
        return torch.cat([x, injected], dim=1)

    def readout(
        self,
        carried: torch.Tensor,
        live: torch.Tensor,
        meta: AttentionMetadata,
        k_caches: list[torch.Tensor],
        v_caches: list[torch.Tensor],
        ops: LoopOps,
    ) -> torch.Tensor:
        """The coda's output [rows, hidden] on the `live` rows' state (ln_f first); only
        they stream its weights' row tiles and write its K/V."""
        cfg = self.config
        out = ops.rms_norm(carried[:, : cfg.hidden_size], self.ln_f, cfg.rms_norm_eps)
        once = meta.single_plane(writes=live)
        first_coda = cfg.num_prelude_layers + cfg.num_core_layers
        for i in range(first_coda, first_coda + cfg.num_coda_layers):
            out = self._layer(ops, out, i, k_caches[i], v_caches[i], once, live)
        return out

    def coda(
        self,
        readout: torch.Tensor,
        ops: LoopOps | None = None,
        live: torch.Tensor | None = None,
        upcast: bool = True,
    ) -> torch.Tensor:
        """LM-head logits [rows, vocab] in float32 (`upcast` False: in the head's dtype) of
        the coda's output: ln_f, then the head (rows not `live` may be zeros with `ops`)."""
        if ops is None:
            logits = F.linear(rms_norm(readout, self.ln_f, self._eps), self.lm_head)
        else:
            normed = ops.rms_norm(readout, self.ln_f, self._eps)
            logits = ops.linear(normed, self.lm_head, live)
        return logits.float() if upcast else logits

    @property
    def _eps(self) -> float:
        return self.config.rms_norm_eps

    def _layer(
        self,
        ops: LoopOps,
        x: torch.Tensor,  # [rows, hidden]
        index: int,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        live: torch.Tensor | None = None,  # [rows] bool: rows whose output is used
    ) -> torch.Tensor:
        """One SandwichBlock over the rows; [rows, hidden] (rows not `live` may hold
        anything: the products skip weight tiles none of whose rows is live)."""
        layer, heads, eps = self.layers[index], self.config.num_attention_heads, self._eps
        norm_1, norm_2, norm_3, norm_4 = layer.norms
        qkv = ops.linear(ops.rms_norm(x, norm_1, eps), layer.qkv, live)
        if layer.qk_bias is not None:
            qkv[:, : 2 * x.shape[1]] += layer.qk_bias.view(-1)
        attn = ops.attention(
            qkv[:, self.columns], heads, heads, k_cache, v_cache, meta, self.rotary, self.scale
        )
        _, x = ops.linear_add_rms_norm2(x, attn, layer.proj, None, norm_2, eps, live)
        gate, up = ops.linear(ops.rms_norm(x, norm_3, eps), layer.fc, live).chunk(2, dim=1)
        _, x = ops.linear_add_rms_norm2(x, F.silu(gate) * up, layer.down, None, norm_4, eps, live)
        return x
