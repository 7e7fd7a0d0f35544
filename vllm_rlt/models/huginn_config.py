"""Huginn-0125's config.json (RavenConfig, model_type `huginn_raven`), parsed strictly: the
fields that shape the computation by type and range, the settings the public modeling code
fixes checked to be those, and nothing else accepted silently."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from vllm_rlt.models.hf_config import (
    COMMON_HARMLESS_KEYS,
    MAX_HEAD_DIM,
    MAX_HEADS,
    MAX_LAYERS,
    MAX_LOOPS,
    MAX_POSITIONS,
    MAX_ROPE_THETA,
    MAX_VOCAB_SIZE,
    MAX_WIDTH,
    config_bool,
    config_float,
    config_int,
    eos_token_ids,
    shown,
)

# RavenConfig keys that record training or bookkeeping and change no inference maths.
_HARMLESS_KEYS = COMMON_HARMLESS_KEYS | {
    "padding_multiple",
    "padded_vocab_size",  # checked to equal vocab_size
    "init_strategy",
    "init_orthogonal",
    "init_values",
    "sampling_scheme",
    "mean_backprop_depth",
    "activation_checkpoint_impl",
    "effective_expected_depth",
    "n_layers",  # checked to be the sum of the three stages
    "num_attention_heads",
    "num_key_value_heads",
    "hidden_size",
    "num_hidden_layers",
    "head_dim",
    "tie_word_embeddings",
    "test_time_noise",  # checked to be 0
    "test_time_noise_type",
}
# Settings the public modeling code implements only one way: other values are refused.
FIXED_SETTINGS = {
    "architecture_class_name": "RecurrentGPT",
    "block_class_name": "SandwichBlock",
    "norm_class_name": "RMSNorm_llama",
    "mlp_class_name": "GatedMLP",
    "nonlin_name": "SiLU",
    "injection_type": "linear",
    "state_init": "like-init",
}


@dataclass(frozen=True)
class HuginnConfig:
    """The Huginn fields the engine reads, under the names the engine's other families use
    (config.json's names in the comments)."""

    vocab_size: int  # vocab_size (= padded_vocab_size)
    hidden_size: int  # n_embd
    intermediate_size: int  # intermediate_size
    num_attention_heads: int  # n_heads; every head is a K/V head
    num_prelude_layers: int  # n_layers_in_prelude: run once per token, before the loop
    num_core_layers: int  # n_layers_in_recurrent_block: the looped block
    num_coda_layers: int  # n_layers_in_coda: run on the state a token exits with
    mean_recurrence: int  # mean_recurrence: the loops a token runs at full depth
    rms_norm_eps: float  # norm_eps
    rope_theta: float  # rope_base
    qk_bias: bool  # qk_bias: q and k get a per-head bias before RoPE
    adapter_bias: bool  # bias: the input-injection adapter has a bias
    tie_word_embeddings: bool  # tie_embeddings
    max_position_embeddings: int  # block_size: the RoPE table and context limit
    # Not RavenConfig's: how far the initial state spreads (the public generate's
    # `init_scale`; 0 starts every token from zeros, deterministic).
    init_scale: float = 1.0
    # The default exit_threshold of a request: 0 never exits before max_loops (the public
    # generate's fixed num_steps); a request may ask for an adaptive depth.
    exit_threshold: float = 0.0
    eos_token_ids: tuple[int, ...] = ()

    @property
    def num_key_value_heads(self) -> int:
        return self.num_attention_heads

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def num_hidden_layers(self) -> int:
        """Attention layers in all: prelude, block and coda."""
        return self.num_prelude_layers + self.num_core_layers + self.num_coda_layers

    @property
    def num_loops(self) -> int:
        return self.mean_recurrence

    @property
    def embed_scale(self) -> float:
        """Embeddings and the drawn initial state are multiplied by sqrt(n_embd)."""
        return math.sqrt(self.hidden_size)

    @property
    def state_std(self) -> float:
        """The initial state's standard deviation before `embed_scale`: RavenConfig's
        init_values["std"], sqrt(2 / (5 n_embd)), times init_scale."""
        return math.sqrt(2 / (5 * self.hidden_size)) * self.init_scale

    def kv_planes(self, planes: int) -> tuple[int, ...]:
        """Prelude and coda layers run once per token (one plane); the block loops."""
        return (
            (1,) * self.num_prelude_layers
            + (planes,) * self.num_core_layers
            + (1,) * self.num_coda_layers
        )

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> HuginnConfig:
        """Parse config.json; a value out of range, a setting the maths does not implement
        or an unknown key is an error naming the field."""
        known = {
            "vocab_size",
            "n_embd",
            "intermediate_size",
            "n_heads",
            "n_layers_in_prelude",
            "n_layers_in_recurrent_block",
            "n_layers_in_coda",
            "mean_recurrence",
            "norm_eps",
            "rope_base",
            "qk_bias",
            "bias",
            "tie_embeddings",
            "block_size",
            "init_scale",
        }
        unknown = sorted(set(raw) - known - _HARMLESS_KEYS - set(FIXED_SETTINGS))
        if unknown:
            raise ValueError(f"config.json: unsupported Huginn config keys: {', '.join(unknown)}")
        for name, value in FIXED_SETTINGS.items():
            if raw.get(name, value) != value:
                raise ValueError(
                    f"config.json: {name} must be {value!r} (the only one implemented), got "
                    f"{shown(raw[name])}"
                )
        if raw.get("test_time_noise", 0) != 0:
            raise ValueError(
                f"config.json: test_time_noise must be 0, got {shown(raw['test_time_noise'])}"
            )
        hidden = config_int(raw, "n_embd", 1, MAX_WIDTH, default=5280)
        heads = config_int(raw, "n_heads", 1, MAX_HEADS, default=55)
        dim, remainder = divmod(hidden, heads)
        if remainder or dim % 2 or not 2 <= dim <= MAX_HEAD_DIM:
            raise ValueError(
                f"config.json: n_embd / n_heads must be an even head size in [2, "
                f"{MAX_HEAD_DIM}], got {hidden} / {heads}"
            )
        for name in ("num_key_value_heads", "num_attention_heads"):
            if raw.get(name, heads) != heads:
                raise ValueError(f"config.json: {name} must equal n_heads ({heads})")
        vocab = config_int(raw, "vocab_size", 1, MAX_VOCAB_SIZE, default=65536)
        if raw.get("padded_vocab_size", vocab) != vocab:
            raise ValueError(
                f"config.json: padded_vocab_size must equal vocab_size ({vocab}), got "
                f"{shown(raw['padded_vocab_size'])}"
            )
        stages = [
            config_int(raw, name, low, MAX_LAYERS, default=default)
            for name, low, default in (
                ("n_layers_in_prelude", 0, 2),
                ("n_layers_in_recurrent_block", 1, 4),
                ("n_layers_in_coda", 0, 2),
            )
        ]
        if raw.get("n_layers", sum(stages)) != sum(stages):
            raise ValueError(
                f"config.json: n_layers must be the sum of the prelude, recurrent-block and "
                f"coda layers ({sum(stages)}), got {shown(raw['n_layers'])}"
            )
        tied = config_bool(raw, "tie_embeddings", True)
        if raw.get("tie_word_embeddings", tied) != tied:
            raise ValueError("config.json: tie_word_embeddings must equal tie_embeddings")
        return cls(
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=config_int(raw, "intermediate_size", 1, MAX_WIDTH, default=17920),
            num_attention_heads=heads,
            num_prelude_layers=stages[0],
            num_core_layers=stages[1],
            num_coda_layers=stages[2],
            mean_recurrence=config_int(raw, "mean_recurrence", 1, MAX_LOOPS, default=32),
            rms_norm_eps=config_float(raw, "norm_eps", 0.0, 1.0, 1e-6, low_open=True),
            rope_theta=config_float(raw, "rope_base", 1.0, MAX_ROPE_THETA, 50_000.0),
            qk_bias=config_bool(raw, "qk_bias", True),
            adapter_bias=config_bool(raw, "bias", False),
            tie_word_embeddings=tied,
            max_position_embeddings=config_int(raw, "block_size", 1, MAX_POSITIONS, default=4096),
            init_scale=config_float(raw, "init_scale", 0.0, 1e3, 1.0),
            eos_token_ids=eos_token_ids(raw, vocab),
        )

    def layer_prefixes(self) -> list[str]:
        """Every attention layer's checkpoint prefix, in `kv_planes` order."""
        return [
            f"transformer.{stage}.{index}."
            for stage, count in (
                ("prelude", self.num_prelude_layers),
                ("core_block", self.num_core_layers),
                ("coda", self.num_coda_layers),
            )
            for index in range(count)
        ]

    def optional_tensors(self) -> frozenset[str]:
        """A tied checkpoint may carry the head a second time (the published one does)."""
        return frozenset({"lm_head.weight"}) if self.tie_word_embeddings else frozenset()

    def checkpoint_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor of a Huginn checkpoint and its shape."""
        h, inter, dim = self.hidden_size, self.intermediate_size, self.head_dim
        shapes: dict[str, tuple[int, ...]] = {
            "transformer.wte.weight": (self.vocab_size, h),
            "transformer.adapter.weight": (h, 2 * h),
            "transformer.ln_f.weight": (h,),
        }
        if self.adapter_bias:
            shapes["transformer.adapter.bias"] = (h,)
        if not self.tie_word_embeddings:
            shapes["lm_head.weight"] = (self.vocab_size, h)
        for prefix in self.layer_prefixes():
            for norm in ("norm_1", "norm_2", "norm_3", "norm_4"):
                shapes[f"{prefix}{norm}.weight"] = (h,)
            shapes[prefix + "attn.Wqkv.weight"] = (3 * h, h)
            if self.qk_bias:
                shapes[prefix + "attn.qk_bias"] = (2, 1, self.num_attention_heads, dim)
            shapes[prefix + "attn.proj.weight"] = (h, h)
            shapes[prefix + "mlp.fc.weight"] = (2 * inter, h)
            shapes[prefix + "mlp.proj.weight"] = (h, inter)
        return shapes
