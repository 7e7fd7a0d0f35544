"""Nanbeige: the published config, refusals, and engine logprobs against a dense recompute."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import save_file

from vllm_rlt import LLM, SamplingParams
from vllm_rlt.models.nanbeige import NanbeigeConfig

PUBLISHED = {
    "architectures": ["NanbeigeForCausalLM"],
    "model_type": "nanbeige",
    "vocab_size": 166144,
    "hidden_size": 3072,
    "intermediate_size": 10752,
    "num_hidden_layers": 22,
    "num_loops": 2,
    "num_attention_heads": 48,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "hidden_act": "silu",
    "max_position_embeddings": 262144,
    "rope_theta": 70000000.0,
    "rope_scaling": None,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "rms_norm_eps": 1e-5,
    "skip_loop_final_norm": False,
    "loop_loss_weights": [],
    "tie_word_embeddings": False,
    "pad_token_id": 0,
    "bos_token_id": 166100,
    "eos_token_id": 166101,
    "torch_dtype": "bfloat16",
    "pretraining_tp": 1,
    "initializer_range": 0.02,
}

TINY = {
    **PUBLISHED,
    "vocab_size": 300,
    "hidden_size": 48,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 6,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 512,
    "rope_theta": 10000.0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def test_published_config_gives_the_published_parameter_count():
    config = NanbeigeConfig.from_dict(PUBLISHED)
    shapes = config.checkpoint_shapes()
    assert sum(math.prod(shape) for shape in shapes.values()) == 4_169_800_704
    assert (config.num_loops, config.head_dim, config.eos_token_ids) == (2, 128, (166101,))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"enable_hyper_connection": True}, "enable_hyper_connection"),
        ({"skip_loop_final_norm": True}, "skip_loop_final_norm"),
        ({"loop_loss_weights": [0.5]}, "loop_loss_weights"),
        ({"attention_bias": True}, "attention_bias"),
        ({"mystery": 1}, "mystery"),
        ({"num_attention_heads": 5}, "multiple"),
    ],
)
def test_unsupported_configs_are_refused(change, message):
    with pytest.raises(ValueError, match=message):
        NanbeigeConfig.from_dict({**PUBLISHED, **change})


def _tiny_weights() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(5)
    weights = {}
    for name, shape in NanbeigeConfig.from_dict(TINY).checkpoint_shapes().items():
        if name.endswith("norm.weight"):
            weights[name] = 1 + 0.1 * torch.randn(shape, generator=generator)
        else:
            scale = 3.0 if name == "lm_head.weight" else 1.0
            weights[name] = torch.randn(shape, generator=generator) * scale / shape[-1] ** 0.5
    return weights


def _dense_logits(w: dict[str, torch.Tensor], ids: list[int]) -> torch.Tensor:
    """The Nanbeige forward written out: every loop runs the Llama stack, then the final norm."""
    cfg = TINY
    heads, kv_heads, d = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]

    def norm(x, g):
        return g * (x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + cfg["rms_norm_eps"]))

    n = len(ids)
    inv = 1.0 / cfg["rope_theta"] ** (torch.arange(0, d, 2).float() / d)
    angles = torch.outer(torch.arange(n).float(), inv)
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()

    def rope(x):  # [n, h, d]
        x1, x2 = x[..., : d // 2], x[..., d // 2 :]
        return x * cos[:, None] + torch.cat([-x2, x1], -1) * sin[:, None]

    x = w["model.embed_tokens.weight"][ids]
    mask = torch.ones(n, n, dtype=torch.bool).tril()
    for _ in range(cfg["num_loops"]):
        for layer in range(cfg["num_hidden_layers"]):
            p = f"model.layers.{layer}."
            a = norm(x, w[p + "input_layernorm.weight"])
            q = rope((a @ w[p + "self_attn.q_proj.weight"].T).view(n, heads, d))
            k = rope((a @ w[p + "self_attn.k_proj.weight"].T).view(n, kv_heads, d))
            v = (a @ w[p + "self_attn.v_proj.weight"].T).view(n, kv_heads, d)
            k = k.repeat_interleave(heads // kv_heads, 1)
            v = v.repeat_interleave(heads // kv_heads, 1)
            scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(d)
            probs = scores.masked_fill(~mask, float("-inf")).softmax(-1)
            attn = torch.einsum("hqk,khd->qhd", probs, v).reshape(n, heads * d)
            x = x + attn @ w[p + "self_attn.o_proj.weight"].T
            b = norm(x, w[p + "post_attention_layernorm.weight"])
            gate, up = b @ w[p + "mlp.gate_proj.weight"].T, b @ w[p + "mlp.up_proj.weight"].T
            x = x + (torch.nn.functional.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T
        x = norm(x, w["model.norm.weight"])
    return x @ w["lm_head.weight"].T


@pytest.mark.parametrize("layout", ["last_exited", "shared", "shared_decode"])
def test_engine_matches_a_dense_recompute(tmp_path, layout):
    """Fixed depth 2 with LAST_EXITED is exactly the HF computation; SHARED equals it on a
    one-token prompt's first token (nothing earlier to read), SHARED_DECODE on any prompt's
    first token (its prompt computes as under LAST_EXITED)."""
    weights = _tiny_weights()
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    save_file(weights, str(tmp_path / "model.safetensors"))
    from vllm_rlt import CacheConfig

    llm = LLM(model=str(tmp_path), cache_config=CacheConfig(layout=layout, num_blocks=64))
    prompt = [5] if layout == "shared" else [5, 77, 123, 9, 250, 31, 64]
    params = SamplingParams(max_tokens=6, temperature=0.0, logprobs=3, ignore_eos=True)
    completion = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    assert completion.exit_depths == [2] * 6
    checked = len(completion.token_ids) if layout == "last_exited" else 1
    dense = _dense_logits(weights, prompt + completion.token_ids[:-1]).log_softmax(-1)
    for step in range(checked):
        row = dense[len(prompt) - 1 + step]
        assert completion.token_ids[step] == int(row.argmax())
        for token, logprob in completion.logprobs[step].items():
            assert logprob.logprob == pytest.approx(float(row[token]), abs=1e-4)
    assert llm.engine.all_blocks_free()
