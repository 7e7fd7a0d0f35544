"""Pieces every family's config.json parser shares: harmless keys, eos ids, tensor shapes."""

from __future__ import annotations

from typing import Any

# Keys real checkpoints carry that do not change the computation.
COMMON_HARMLESS_KEYS = frozenset(
    {
        "architectures",
        "auto_map",
        "transformers_version",
        "torch_dtype",
        "dtype",
        "use_cache",
        "_name_or_path",
        "initializer_range",
        "attention_dropout",
        "hidden_act",
        "pad_token_id",
        "bos_token_id",
        "eos_token_id",
        "rope_scaling",
        "model_type",
    }
)


def eos_token_ids(raw: dict[str, Any]) -> tuple[int, ...]:
    """config.json's eos_token_id may be an id, a list of ids, or absent."""
    eos = raw.get("eos_token_id")
    if isinstance(eos, list):
        return tuple(eos)
    return () if eos is None else (eos,)


def llama_layer_shapes(
    config, branch_norms: bool, extra: dict[str, tuple[int, ...]] | None = None
) -> dict[str, tuple[int, ...]]:
    """Embedding, final norm, `extra` tensors, LM head and every layer's tensors, named as
    in HF Llama-style checkpoints; `branch_norms` adds Ouro's two sandwich norms per layer.
    The order is fixed: the built-in model draws its seeded weights in this order."""
    h, i, d = config.hidden_size, config.intermediate_size, config.head_dim
    q_out, kv_out = config.num_attention_heads * d, config.num_key_value_heads * d
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (config.vocab_size, h),
        "model.norm.weight": (h,),
        **(extra or {}),
    }
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, h)
    norms = ["input_layernorm", "post_attention_layernorm"]
    if branch_norms:
        norms = [
            "input_layernorm",
            "input_layernorm_2",
            "post_attention_layernorm",
            "post_attention_layernorm_2",
        ]
    for layer in range(config.num_hidden_layers):
        p = f"model.layers.{layer}."
        shapes[p + "self_attn.q_proj.weight"] = (q_out, h)
        shapes[p + "self_attn.k_proj.weight"] = (kv_out, h)
        shapes[p + "self_attn.v_proj.weight"] = (kv_out, h)
        shapes[p + "self_attn.o_proj.weight"] = (h, q_out)
        shapes[p + "mlp.gate_proj.weight"] = (i, h)
        shapes[p + "mlp.up_proj.weight"] = (i, h)
        shapes[p + "mlp.down_proj.weight"] = (h, i)
        for norm in norms:
            shapes[p + norm + ".weight"] = (h,)
    return shapes
