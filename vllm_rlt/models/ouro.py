"""Ouro 1.4B / 2.6B (HF `modeling_ouro.py`) as prelude / core / coda over packed rows."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, fields
from typing import Any

import torch
import torch.nn.functional as F

from vllm_rlt.config import check_quantization
from vllm_rlt.layers.fp8 import Fp8Weight, is_float8, weight_nbytes
from vllm_rlt.layers.rotary import RotaryEmbedding
from vllm_rlt.models.hf_config import (
    COMMON_HARMLESS_KEYS,
    MAX_LOOPS,
    config_float,
    config_int,
    llama_fields,
    llama_layer_shapes,
    shown,
)
from vllm_rlt.models.interface import RankGroup, StepInputs
from vllm_rlt.models.ouro_layer import PROJECTIONS, OuroLayerWeights
from vllm_rlt.ops.base import LoopOps
from vllm_rlt.ops.metadata import AttentionMetadata

_HARMLESS_KEYS = COMMON_HARMLESS_KEYS | {
    "max_window_layers",
    "use_sliding_window",
    "sliding_window",
    "layer_types",
    "early_exit_step",
}


@dataclass(frozen=True)
class OuroConfig:
    """The Ouro fields that shape the computation, parsed strictly from config.json."""

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
    total_ut_steps: int
    exit_threshold: float = 1.0  # config.json: early_exit_threshold
    tie_word_embeddings: bool = False
    eos_token_ids: tuple[int, ...] = ()

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> OuroConfig:
        """Parse config.json; unknown keys, unsupported settings and values of the wrong type
        or out of range are errors naming the field, not surprises."""
        # the file's keys: the fields, but the threshold under the name checkpoints give it
        known = {f.name for f in fields(cls)} - {"eos_token_ids", "exit_threshold"}
        known.add("early_exit_threshold")
        unknown = sorted(set(raw) - known - _HARMLESS_KEYS)
        if unknown:
            raise ValueError(f"config.json: unsupported Ouro config keys: {', '.join(unknown)}")
        if raw.get("hidden_act", "silu") != "silu":
            raise ValueError(
                f"config.json: hidden_act must be 'silu', got {shown(raw['hidden_act'])}"
            )
        if raw.get("use_sliding_window") not in (None, False):
            raise ValueError(
                "config.json: use_sliding_window must be false (sliding windows are not "
                f"supported), got {shown(raw['use_sliding_window'])}"
            )
        layer_types = raw.get("layer_types")
        if layer_types is not None and (
            not isinstance(layer_types, list)
            or any(kind != "full_attention" for kind in layer_types)
        ):
            raise ValueError(
                f"config.json: layer_types must all be 'full_attention', got {shown(layer_types)}"
            )
        if raw.get("rope_scaling") not in (None, {}):
            raise ValueError("config.json: rope_scaling is not supported")
        if raw.get("early_exit_step") is not None:
            raise ValueError("config.json: early_exit_step is not supported")
        return cls(
            **llama_fields(raw, 1e-6, 2048, ("head_dim",)),
            total_ut_steps=config_int(raw, "total_ut_steps", 1, MAX_LOOPS, default=4),
            exit_threshold=config_float(raw, "early_exit_threshold", 0.0, 1.0, 1.0),
        )

    @property
    def num_loops(self) -> int:
        return self.total_ut_steps

    def kv_planes(self, planes: int) -> tuple[int, ...]:
        """Every layer loops: each keeps `planes`."""
        return (planes,) * self.num_hidden_layers

    def checkpoint_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor name of an HF Ouro checkpoint and its shape."""
        gate = {
            "model.early_exit_gate.weight": (1, self.hidden_size),
            "model.early_exit_gate.bias": (1,),
        }
        return llama_layer_shapes(self, branch_norms=True, extra=gate)


class OuroModel:
    """Ouro weights and one loop of a pass (`step`): loop-0 rows start from their embedded
    token (prelude), every row runs the shared layer stack once (core), ending with the
    per-loop final norm; gate(hidden) and coda(hidden) read that normalised state.
    """

    # The whole stack loops: a row starts from its embedded token and exits with its state.
    draws_initial_state = False
    separate_readout = False
    exit_policy = "ouro"  # ExitConfig mode "auto": the checkpoint's exit gate

    def __init__(
        self, config: OuroConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype, device
    ) -> None:
        self.config = config
        self.dtype = dtype
        self.device = torch.device(device)

        def take(name: str) -> torch.Tensor:
            # a copy: the model owns its storage (a file-backed one cannot be released);
            # float8 values (an FP8 checkpoint's projections) keep their bytes, as uint8
            # (fused like any weight on every device), for `install_fp8_scales`
            tensor = weights[name]
            if is_float8(tensor):
                return tensor.view(torch.uint8).to(self.device, copy=True).contiguous()
            return tensor.to(device=self.device, dtype=dtype, copy=True).contiguous()

        self.embed = take("model.embed_tokens.weight")  # [vocab, hidden]
        self.lm_head = self.embed if config.tie_word_embeddings else take("lm_head.weight")
        self.final_norm = take("model.norm.weight")  # [hidden]
        self._load_gate(take)
        self.layers = [
            self._load_layer(take, f"model.layers.{layer}.")
            for layer in range(config.num_hidden_layers)
        ]
        self.rotary = RotaryEmbedding(
            config.head_dim, config.rope_theta, config.max_position_embeddings, dtype, self.device
        )
        self.scale = 1.0 / math.sqrt(config.head_dim)

    def _load_gate(self, take) -> None:
        self.gate_weight = take("model.early_exit_gate.weight")  # [1, hidden]
        self.gate_bias = take("model.early_exit_gate.bias")  # [1]

    # Ouro wraps each branch output in its own norm before the residual add.
    branch_norms = True
    # Set by `shard` on a model split over ranks.
    tensor_parallel: RankGroup | None = None
    # Set by `quantize` and `install_fp8_scales`: the layer projections are Fp8Weight.
    quantization: str | None = None

    def _load_layer(self, take, prefix: str) -> OuroLayerWeights:
        def branch_norm(name: str) -> torch.Tensor | None:
            return take(prefix + name + ".weight") if self.branch_norms else None

        return OuroLayerWeights(
            qkv=torch.cat([take(prefix + f"self_attn.{n}_proj.weight") for n in ("q", "k", "v")]),
            o=take(prefix + "self_attn.o_proj.weight"),
            # Interleaved, so any strip of GEMM output columns holds matching gate and up
            # values and the SiLU-mul can run in the GEMM's epilogue.
            gate_up=torch.stack(
                [take(prefix + "mlp.gate_proj.weight"), take(prefix + "mlp.up_proj.weight")], 1
            ).flatten(0, 1),
            down=take(prefix + "mlp.down_proj.weight"),
            attn_norm=take(prefix + "input_layernorm.weight"),
            attn_out_norm=branch_norm("input_layernorm_2"),
            mlp_norm=take(prefix + "post_attention_layernorm.weight"),
            mlp_out_norm=branch_norm("post_attention_layernorm_2"),
        )

    def shard(self, group: RankGroup) -> None:
        """Keep this rank's share of every layer (in place) and all-reduce the row-parallel
        products (parallel/tensor_parallel.py); the config then describes this rank's
        share."""
        cfg, world = self.config, group.world
        for layer in self.layers:
            layer.shard(group.rank, world, cfg)
        self.config = dataclasses.replace(
            cfg,
            num_attention_heads=cfg.num_attention_heads // world,
            num_key_value_heads=cfg.num_key_value_heads // world,
            intermediate_size=cfg.intermediate_size // world,
        )
        self.tensor_parallel = group

    def quantize(self, kind: str | None) -> None:
        """Quantize the layer projections in place (None: leave them); the embedding, the
        LM head, the gate and the norms keep the model's dtype."""
        check_quantization(kind)
        if kind is None:
            return
        for layer in self.layers:
            layer.quantize()
        self.quantization = kind

    def install_fp8_scales(
        self,
        scales: dict[str, torch.Tensor],
        kv_scales: list[tuple[torch.Tensor, torch.Tensor]] | None,
    ) -> None:
        """Pair the fused float8 projections (built from an FP8 checkpoint's bytes) with the
        checkpoint's row scales ([rows] float32 by projection weight name), fused the same
        way (q/k/v stacked, gate/up interleaved), and give the layers their K/V cache
        scales (per layer, [kv_heads] each)."""

        def take(name: str) -> torch.Tensor:
            # a norm has no scale: it is built and dropped
            return scales[name].to(self.device) if name in scales else torch.empty(0)

        for index, layer in enumerate(self.layers):
            layer.pair_scales(self._load_layer(take, f"model.layers.{index}."))
            if kv_scales is not None:
                layer.kv_scales = tuple(scale.to(self.device) for scale in kv_scales[index])
        self.quantization = "fp8"

    def streamed_bytes(self) -> tuple[int, int, int, int]:
        """Every loop streams every layer's projections and the LM head (a row may exit
        after any loop) and reads every layer's K/V."""
        layers = sum(
            weight_nbytes(getattr(layer, name)) for layer in self.layers for name in PROJECTIONS
        )
        head = self.lm_head.numel() * self.lm_head.element_size()
        return layers + head, 0, len(self.layers), 0

    def checkpoint_views(self) -> dict[str, torch.Tensor | Fp8Weight]:
        """Every checkpoint tensor name and the view of this model's tensors that holds it
        (q/k/v are row ranges of qkv, gate/up the even and odd rows of gate_up), so that new
        weights can be copied in place: the KV cache, CUDA graphs and kernels keep reading
        the same storage. Under fp8 a projection's views are Fp8Weight row views, whose
        copy_ quantizes into them."""
        cfg = self.config
        views = {"model.embed_tokens.weight": self.embed, "model.norm.weight": self.final_norm}
        if not cfg.tie_word_embeddings:
            views["lm_head.weight"] = self.lm_head
        if self.gate_weight is not None:
            views["model.early_exit_gate.weight"] = self.gate_weight
            views["model.early_exit_gate.bias"] = self.gate_bias
        q = cfg.num_attention_heads * cfg.head_dim
        kv = cfg.num_key_value_heads * cfg.head_dim
        for index, layer in enumerate(self.layers):
            prefix = f"model.layers.{index}."
            views.update(
                {
                    prefix + "self_attn.q_proj.weight": layer.qkv[:q],
                    prefix + "self_attn.k_proj.weight": layer.qkv[q : q + kv],
                    prefix + "self_attn.v_proj.weight": layer.qkv[q + kv :],
                    prefix + "self_attn.o_proj.weight": layer.o,
                    prefix + "mlp.gate_proj.weight": layer.gate_up[0::2],
                    prefix + "mlp.up_proj.weight": layer.gate_up[1::2],
                    prefix + "mlp.down_proj.weight": layer.down,
                    prefix + "input_layernorm.weight": layer.attn_norm,
                    prefix + "post_attention_layernorm.weight": layer.mlp_norm,
                }
            )
            if self.branch_norms:
                views[prefix + "input_layernorm_2.weight"] = layer.attn_out_norm
                views[prefix + "post_attention_layernorm_2.weight"] = layer.mlp_out_norm
        return views

    def step(
        self,
        rows: StepInputs,
        meta: AttentionMetadata,
        k_caches: list[torch.Tensor],
        v_caches: list[torch.Tensor],
        ops: LoopOps,
    ) -> torch.Tensor:
        """One loop of every row: its state, which it carries (see LoopedModel)."""
        first = (rows.loops == 0).unsqueeze(1)
        return self.core(
            torch.where(first, self.prelude(rows.tokens), rows.carried),
            meta,
            k_caches,
            v_caches,
            ops,
        )

    def readout(self, carried: torch.Tensor, live, meta, k_caches, v_caches, ops) -> torch.Tensor:
        """No layers after the loop: a row exits with its state."""
        return carried

    @property
    def carried_width(self) -> int:
        return self.config.hidden_size

    def prelude(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Embed token ids [rows] into the residual stream [rows, hidden]."""
        return self.embed[token_ids]

    def core(
        self,
        hidden: torch.Tensor,  # [rows, hidden]
        meta: AttentionMetadata,
        k_caches: list[torch.Tensor],  # per layer [planes * slots_per_plane, kv_heads, head_dim]
        v_caches: list[torch.Tensor],
        ops: LoopOps,
    ) -> torch.Tensor:
        """One loop of the layer stack, ending with the per-loop final norm; [rows, hidden].

        Each residual add is fused with the projection before it and the norm after it: the
        post-attention add with o and the pre-MLP norm, the post-MLP add with down and the
        next layer's pre-attention norm (or, after the last layer, the loop's final norm). A
        family without sandwich
        norms (branch norm None) adds the branch as it is.
        """
        cfg = self.config
        eps = cfg.rms_norm_eps
        x = hidden
        a = ops.rms_norm(x, self.layers[0].attn_norm, eps, self.layers[0].qkv)
        for index, layer in enumerate(self.layers):
            attn = ops.attention(
                ops.linear(a, layer.qkv),
                cfg.num_attention_heads,
                cfg.num_key_value_heads,
                k_caches[index],
                v_caches[index],
                meta,
                self.rotary,
                self.scale,
                layer.kv_scales,
            )
            x, b = self._add_branch(
                ops, x, attn, layer.o, layer.attn_out_norm, layer.mlp_norm, layer.gate_up
            )
            mlp = ops.linear_silu_mul(b, layer.gate_up, layer.down)
            if index + 1 < len(self.layers):
                w_next, next_qkv = self.layers[index + 1].attn_norm, self.layers[index + 1].qkv
            else:
                w_next, next_qkv = self.final_norm, None  # the loop's output stays a tensor
            x, a = self._add_branch(ops, x, mlp, layer.down, layer.mlp_out_norm, w_next, next_qkv)
        return a

    def _add_branch(
        self,
        ops: LoopOps,
        x: torch.Tensor,
        inp: torch.Tensor,
        weight: torch.Tensor | Fp8Weight,
        w_branch: torch.Tensor | None,
        w_next: torch.Tensor,
        next_weight: torch.Tensor | Fp8Weight | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual add of a branch projected by `weight`, fused with the norms around
        it; under tensor parallelism the ranks' partial products are summed first. The
        second norm's output feeds `next_weight` (the ops may hand it on quantized)."""
        eps = self.config.rms_norm_eps
        if self.tensor_parallel is None:
            return ops.linear_add_rms_norm2(
                x, inp, weight, w_branch, w_next, eps, next_weight=next_weight
            )
        branch = self.tensor_parallel.all_reduce(ops.linear(inp, weight))
        return ops.add_rms_norm2(x, branch, w_branch, w_next, eps, next_weight)

    def gate(self, hidden: torch.Tensor) -> torch.Tensor:
        """Exit-gate logits [rows] in float32 from the end-of-loop state [rows, hidden]."""
        return F.linear(hidden, self.gate_weight, self.gate_bias).float().squeeze(-1)

    def coda(
        self,
        hidden: torch.Tensor,
        ops: LoopOps | None = None,
        live: torch.Tensor | None = None,
        upcast: bool = True,
    ) -> torch.Tensor:
        """LM-head logits [rows, vocab] in float32 (`upcast` False: in the head's dtype).
        With `ops` and `live` (rows whose tokens are used), a backend may leave the logits
        of other rows at zero."""
        if ops is None:
            logits = F.linear(hidden, self.lm_head)
        else:
            logits = ops.linear(hidden, self.lm_head, live)
        return logits.float() if upcast else logits
