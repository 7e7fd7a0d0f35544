"""Pieces every family's config.json parser shares: harmless keys, fields read by type and
range, token ids, tensor shapes."""

from __future__ import annotations

import math
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

# Far beyond any published checkpoint, and small enough that sizes computed from them stay
# exact; whether a model of such a shape fits is checked against the device at load.
MAX_VOCAB_SIZE = 2**24
MAX_WIDTH = 2**20  # hidden_size, intermediate_size
MAX_LAYERS = 1024
MAX_HEADS = 4096
MAX_HEAD_DIM = 1024
MAX_POSITIONS = 2**24
MAX_LOOPS = 64  # each loop is a KV plane per position under last_exited
MAX_ROPE_THETA = 1e15
MAX_SHOWN_CHARS = 40


def shown(value: Any) -> str:
    """A config value as an error message shows it: its repr, cut short."""
    text = repr(value)
    return text if len(text) <= MAX_SHOWN_CHARS else text[: MAX_SHOWN_CHARS - 3] + "..."


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def require_keys(raw: dict[str, Any], names: tuple[str, ...]) -> None:
    missing = [name for name in names if name not in raw]
    if missing:
        raise ValueError(f"config.json: missing required keys: {', '.join(missing)}")


def config_int(raw: dict[str, Any], name: str, low: int, high: int, default: Any = None) -> int:
    """raw[name] (or `default` when absent): an integer in [low, high], else a ValueError
    naming the field and the range."""
    value = raw.get(name, default)
    if not _is_int(value) or not low <= value <= high:
        raise ValueError(
            f"config.json: {name} must be an integer in [{low}, {high}], got {shown(value)}"
        )
    return value


def config_float(
    raw: dict[str, Any],
    name: str,
    low: float,
    high: float,
    default: float,
    low_open: bool = False,
) -> float:
    """raw[name] (or `default` when absent): a number in [low, high], or (low, high] with
    `low_open`; NaN, infinities, null and other types are a ValueError naming the range."""
    value = raw.get(name, default)
    number = _is_int(value) or isinstance(value, float)
    above = number and (value > low if low_open else value >= low)
    if not (above and value <= high and math.isfinite(value)):
        bracket = "(" if low_open else "["
        raise ValueError(
            f"config.json: {name} must be a number in {bracket}{low:g}, {high:g}], "
            f"got {shown(value)}"
        )
    return float(value)


def config_bool(raw: dict[str, Any], name: str, default: bool) -> bool:
    value = raw.get(name, default)
    if not isinstance(value, bool):
        raise ValueError(f"config.json: {name} must be true or false, got {shown(value)}")
    return value


def head_dim(raw: dict[str, Any], hidden_size: int, heads: int, keys: tuple[str, ...]) -> int:
    """The first of `keys` that is set, else hidden_size // heads: an even size."""
    name = next((key for key in keys if raw.get(key) is not None), None)
    value = hidden_size // heads if name is None else raw[name]
    label = "head_dim (hidden_size / num_attention_heads)" if name is None else name
    if not _is_int(value) or not 2 <= value <= MAX_HEAD_DIM or value % 2:
        raise ValueError(
            f"config.json: {label} must be an even integer in [2, {MAX_HEAD_DIM}], "
            f"got {shown(value)}"
        )
    return value


def eos_token_ids(raw: dict[str, Any], vocab_size: int) -> tuple[int, ...]:
    """config.json's eos_token_id (an id, a list of ids, or absent), once it and the bos and
    pad ids are checked to be ids of the vocabulary."""
    for name in ("bos_token_id", "pad_token_id"):
        value = raw.get(name)
        if value is not None and not (_is_int(value) and 0 <= value < vocab_size):
            raise ValueError(
                f"config.json: {name} must be a token id in [0, {vocab_size - 1}], "
                f"got {shown(value)}"
            )
    eos = raw.get("eos_token_id")
    ids = [] if eos is None else eos if isinstance(eos, list) else [eos]
    if not all(_is_int(i) and 0 <= i < vocab_size for i in ids):
        raise ValueError(
            f"config.json: eos_token_id must be a token id in [0, {vocab_size - 1}] or a list "
            f"of them, got {shown(eos)}"
        )
    return tuple(ids)


def llama_fields(
    raw: dict[str, Any], rms_norm_eps: float, max_positions: int, head_dim_keys: tuple[str, ...]
) -> dict[str, Any]:
    """The Llama-stack fields every family has, each checked by type and range; the defaults
    of rms_norm_eps and max_position_embeddings are the family's."""
    require_keys(
        raw,
        (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
        ),
    )
    vocab_size = config_int(raw, "vocab_size", 1, MAX_VOCAB_SIZE)
    hidden_size = config_int(raw, "hidden_size", 1, MAX_WIDTH)
    heads = config_int(raw, "num_attention_heads", 1, MAX_HEADS)
    kv_heads = config_int(raw, "num_key_value_heads", 1, MAX_HEADS, default=heads)
    if heads % kv_heads:
        raise ValueError(
            "config.json: num_attention_heads must be a multiple of num_key_value_heads, got "
            f"{heads} and {kv_heads}"
        )
    return {
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": config_int(raw, "intermediate_size", 1, MAX_WIDTH),
        "num_hidden_layers": config_int(raw, "num_hidden_layers", 1, MAX_LAYERS),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim(raw, hidden_size, heads, head_dim_keys),
        "rms_norm_eps": config_float(raw, "rms_norm_eps", 0.0, 1.0, rms_norm_eps, low_open=True),
        "rope_theta": config_float(raw, "rope_theta", 1.0, MAX_ROPE_THETA, 10000.0),
        "max_position_embeddings": config_int(
            raw, "max_position_embeddings", 1, MAX_POSITIONS, default=max_positions
        ),
        "tie_word_embeddings": config_bool(raw, "tie_word_embeddings", False),
        "eos_token_ids": eos_token_ids(raw, vocab_size),
    }


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
