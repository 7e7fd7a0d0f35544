"""HF checkpoint folders: the toy round-trips exactly, and every bad folder gets a clear error.

The loader is the only door real checkpoints come through, so a folder written by
`save_toy_model` must generate exactly what the built-in toy does, and every way a folder can be
wrong must fail at load time with a message that names the problem (docs/design.md §4, §6).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from vllm_rlt import LLM, SamplingParams
from vllm_rlt.models.loader import INDEX_FILE, SINGLE_FILE, load_model
from vllm_rlt.models.ouro import OuroConfig
from vllm_rlt.models.toy import save_toy_model, toy_config_dict, toy_weights
from vllm_rlt.tokenizer import Tokenizer

PROMPTS = ["Hello", "The loop runs", "ab"]
THRESHOLDS = (0.5, 1.0)
MAX_TOKENS = 6
DELETE = object()  # sentinel: remove this key from config.json

Summary = list[tuple[list[int], list[int], str]]


def greedy(threshold: float) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, exit_threshold=threshold)


def summarize(llm: LLM, prompts: list[Any], threshold: float) -> Summary:
    """(token ids, exit depths, text) of each greedy completion."""
    outputs = llm.generate(prompts, greedy(threshold), use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].exit_depths, o.outputs[0].text) for o in outputs]


@pytest.fixture(scope="module")
def builtin() -> dict[float, Summary]:
    """The built-in toy's greedy outputs, the ground truth every loaded folder must match."""
    llm = LLM(model="toy")
    return {q: summarize(llm, PROMPTS, q) for q in THRESHOLDS}


def write_config(folder: Path, changes: dict[str, Any] | None = None) -> None:
    config = toy_config_dict()
    for key, value in (changes or {}).items():
        if value is DELETE:
            config.pop(key, None)
        else:
            config[key] = value
    (folder / "config.json").write_text(json.dumps(config))


def write_model(
    folder: Path,
    config_changes: dict[str, Any] | None = None,
    weights: dict[str, torch.Tensor] | None = None,
) -> Path:
    """A toy folder with an edited config.json and/or a replaced weight set, no tokenizer."""
    folder.mkdir(parents=True, exist_ok=True)
    write_config(folder, config_changes)
    save_file(toy_weights() if weights is None else weights, str(folder / SINGLE_FILE))
    return folder


def write_shards(
    folder: Path, shards: dict[str, dict[str, torch.Tensor]], weight_map: dict
) -> None:
    for name, tensors in shards.items():
        save_file(tensors, str(folder / name))
    index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
    (folder / INDEX_FILE).write_text(json.dumps(index))


def split_toy() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    weights = toy_weights()
    names = sorted(weights)
    half = len(names) // 2
    return {n: weights[n] for n in names[:half]}, {n: weights[n] for n in names[half:]}


SHARD_1 = "model-00001-of-00002.safetensors"
SHARD_2 = "model-00002-of-00002.safetensors"


# ----------------------------------------------------------------- round trips
def test_saved_toy_folder_generates_exactly_like_builtin(tmp_path, builtin):
    """save_toy_model writes a complete HF folder that reproduces the built-in toy exactly."""
    folder = save_toy_model(tmp_path / "toy")
    for name in ("config.json", SINGLE_FILE, "tokenizer.json", "tokenizer_config.json"):
        assert (folder / name).is_file(), name
    llm = LLM(model=str(folder))
    assert llm.model_name == str(folder)
    for q in THRESHOLDS:
        assert summarize(llm, PROMPTS, q) == builtin[q]


def test_sharded_checkpoint_loads_identically(tmp_path, builtin):
    """Two shards plus an index load into the same model as the single file."""
    folder = save_toy_model(tmp_path / "sharded")
    (folder / SINGLE_FILE).unlink()
    first, second = split_toy()
    weight_map = {n: SHARD_1 for n in first} | {n: SHARD_2 for n in second}
    write_shards(folder, {SHARD_1: first, SHARD_2: second}, weight_map)
    llm = LLM(model=str(folder))
    assert summarize(llm, PROMPTS, 0.5) == builtin[0.5]


def test_harmless_checkpoint_keys_are_accepted(tmp_path):
    """Keys that real Ouro checkpoints carry and that do not change the maths must not fail."""
    folder = write_model(
        tmp_path / "m",
        {
            "auto_map": {"AutoConfig": "configuration_ouro.OuroConfig"},
            "transformers_version": "4.55.0",
            "torch_dtype": "bfloat16",
            "use_cache": True,
            "layer_types": ["full_attention", "full_attention"],
            "max_window_layers": 2,
            "use_sliding_window": False,
            "sliding_window": None,
            "_name_or_path": "ByteDance/Ouro-1.4B",
            "initializer_range": 0.02,
        },
    )
    model = load_model(folder, torch.float32, "cpu")
    assert model.config == OuroConfig.from_dict(toy_config_dict())


def test_rotary_inv_freq_buffers_are_ignored(tmp_path, builtin):
    """Exporters that still write rotary_emb.inv_freq buffers produce a loadable checkpoint."""
    weights = toy_weights()
    inv_freq = torch.ones(8)
    weights["model.rotary_emb.inv_freq"] = inv_freq
    weights["model.layers.0.self_attn.rotary_emb.inv_freq"] = inv_freq.clone()
    folder = write_model(tmp_path / "m", weights=weights)
    llm = LLM(model=str(folder))
    ids = [Tokenizer.byte_level().encode(p) for p in PROMPTS]
    tokens = [(t, d) for t, d, _ in summarize(llm, ids, 0.5)]
    assert tokens == [(t, d) for t, d, _ in builtin[0.5]]


def test_folder_without_tokenizer_generates_from_token_ids(tmp_path, builtin):
    """No tokenizer.json: token-id prompts still work; text needs a tokenizer and says so."""
    folder = save_toy_model(tmp_path / "notok")
    (folder / "tokenizer.json").unlink()
    llm = LLM(model=str(folder))
    assert llm.tokenizer is None
    ids: list[Any] = [Tokenizer.byte_level().encode(p) for p in PROMPTS]
    ids[-1] = {"prompt_token_ids": ids[-1]}  # the dict form works without a tokenizer too
    tokens = [(t, d) for t, d, _ in summarize(llm, ids, 0.5)]
    assert tokens == [(t, d) for t, d, _ in builtin[0.5]]
    for text_prompt in ("Hello", ["Hello"], {"prompt": "Hello"}):
        with pytest.raises(ValueError, match=r"without tokenizer.json\); pass prompt_token_ids"):
            llm.generate(text_prompt, greedy(1.0), use_tqdm=False)
    with pytest.raises(ValueError, match="chat needs a tokenizer"):
        llm.chat([{"role": "user", "content": "hi"}], use_tqdm=False)
    assert not llm.engine.has_unfinished and llm.engine.all_blocks_free()


# ----------------------------------------------------------------- folder-level errors
def test_missing_folder(tmp_path):
    missing = tmp_path / "nowhere"
    with pytest.raises(FileNotFoundError, match=r"model folder .*nowhere.* does not exist"):
        LLM(model=str(missing))


def test_missing_config_json(tmp_path):
    folder = tmp_path / "m"
    folder.mkdir()
    save_file(toy_weights(), str(folder / SINGLE_FILE))
    with pytest.raises(FileNotFoundError, match="no config.json"):
        LLM(model=str(folder))


def test_invalid_config_json(tmp_path):
    folder = write_model(tmp_path / "m")
    (folder / "config.json").write_text('{"model_type": "ouro",')
    with pytest.raises(ValueError, match=r"config\.json: invalid JSON"):
        LLM(model=str(folder))


def test_invalid_index_json_names_the_file(tmp_path):
    """Like config.json, a corrupt index must say which file is broken (not a bare decode
    error)."""
    folder = write_model(tmp_path / "m")
    (folder / INDEX_FILE).write_text('{"weight_map": ')
    with pytest.raises(ValueError, match=re.escape(INDEX_FILE)):
        LLM(model=str(folder))


def test_config_json_not_an_object(tmp_path):
    folder = write_model(tmp_path / "m")
    (folder / "config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="expected a JSON object"):
        LLM(model=str(folder))


@pytest.mark.parametrize("model_type", ["llama", DELETE])
def test_unknown_model_type(tmp_path, model_type):
    folder = write_model(tmp_path / "m", {"model_type": model_type})
    with pytest.raises(
        ValueError, match=r"unknown model_type .*; supported: huginn_raven, nanbeige, ouro"
    ):
        LLM(model=str(folder))


def test_pickle_only_folder_is_refused(tmp_path):
    """Pickle weights can execute code on load; the loader refuses them and says why."""
    folder = tmp_path / "m"
    folder.mkdir()
    write_config(folder)
    torch.save(toy_weights(), folder / "pytorch_model.bin")
    with pytest.raises(ValueError, match="only pickle weights found; vllm-rlt loads safetensors"):
        LLM(model=str(folder))


def test_folder_without_weights(tmp_path):
    folder = tmp_path / "m"
    folder.mkdir()
    write_config(folder)
    with pytest.raises(FileNotFoundError, match=f"no {SINGLE_FILE} or {INDEX_FILE}"):
        LLM(model=str(folder))


# ----------------------------------------------------------------- tensor errors
def test_missing_tensor(tmp_path):
    weights = toy_weights()
    del weights["model.layers.1.mlp.up_proj.weight"]
    folder = write_model(tmp_path / "m", weights=weights)
    with pytest.raises(
        ValueError, match=r"missing tensors: model\.layers\.1\.mlp\.up_proj\.weight"
    ):
        LLM(model=str(folder))


def test_unexpected_tensor(tmp_path):
    weights = toy_weights()
    weights["model.layers.0.self_attn.q_norm.weight"] = torch.ones(16)
    folder = write_model(tmp_path / "m", weights=weights)
    with pytest.raises(
        ValueError, match=r"unexpected tensors in checkpoint: model\.layers\.0\.self_attn\.q_norm"
    ):
        LLM(model=str(folder))


def test_wrong_tensor_shape(tmp_path):
    weights = toy_weights()
    weights["model.norm.weight"] = torch.ones(32)
    folder = write_model(tmp_path / "m", weights=weights)
    with pytest.raises(
        ValueError, match=r"tensor model\.norm\.weight has shape \(32,\), expected \(64,\)"
    ):
        LLM(model=str(folder))


def test_tied_embeddings_reject_an_lm_head(tmp_path):
    """tie_word_embeddings=true means no lm_head.weight; a stray one is an unexpected tensor."""
    folder = write_model(tmp_path / "m", {"tie_word_embeddings": True})
    with pytest.raises(ValueError, match=r"unexpected tensors in checkpoint: lm_head\.weight"):
        LLM(model=str(folder))


# ----------------------------------------------------------------- unsupported configs
@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"use_sliding_window": True}, "use_sliding_window must be false"),
        (
            {"layer_types": ["full_attention", "sliding_attention"]},
            "layer_types must all be 'full_attention'",
        ),
        ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_scaling is not supported"),
        ({"hidden_act": "gelu"}, "hidden_act must be 'silu', got 'gelu'"),
        ({"my_new_knob": 1}, "unsupported Ouro config keys: my_new_knob"),
        (
            {"num_key_value_heads": 3},
            "num_attention_heads must be a multiple of num_key_value_heads",
        ),
        ({"hidden_size": DELETE}, "missing required keys: hidden_size"),
        ({"vocab_size": DELETE, "intermediate_size": DELETE}, "vocab_size, intermediate_size"),
        ({"early_exit_step": 2}, "early_exit_step is not supported"),
        ({"num_hidden_layers": 0}, r"num_hidden_layers must be an integer in \[1, 1024\], got 0"),
        ({"total_ut_steps": 2.5}, r"total_ut_steps must be an integer in \[1, 64\], got 2.5"),
        ({"head_dim": 15}, r"head_dim must be an even integer in \[2, 1024\], got 15"),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_unsupported_config(tmp_path, changes, match):
    folder = write_model(tmp_path / "m", changes)
    with pytest.raises(ValueError, match=r"config\.json: .*" + match):
        LLM(model=str(folder))


def test_zero_heads_without_head_dim_is_a_config_error(tmp_path):
    """head_dim defaults to hidden_size // num_attention_heads; a zero head count must be
    reported as a bad config value, not crash with ZeroDivisionError."""
    folder = write_model(tmp_path / "m", {"num_attention_heads": 0, "head_dim": DELETE})
    with pytest.raises(
        ValueError,
        match=r"config\.json: num_attention_heads must be an integer in \[1, 4096\], got 0",
    ):
        LLM(model=str(folder))


# ----------------------------------------------------------------- sharded errors
def test_index_points_at_missing_shard(tmp_path):
    folder = tmp_path / "m"
    folder.mkdir()
    write_config(folder)
    first, second = split_toy()
    missing = "model-00003-of-00003.safetensors"
    weight_map = {n: SHARD_1 for n in first} | {n: missing for n in second}
    write_shards(folder, {SHARD_1: first}, weight_map)
    with pytest.raises(FileNotFoundError, match=f"shard {missing} is missing"):
        LLM(model=str(folder))


def test_tensor_in_two_shards(tmp_path):
    folder = tmp_path / "m"
    folder.mkdir()
    write_config(folder)
    first, second = split_toy()
    duplicated = sorted(second)[0]
    first_with_dup = first | {duplicated: second[duplicated]}
    weight_map = {n: SHARD_1 for n in first} | {n: SHARD_2 for n in second}
    write_shards(folder, {SHARD_1: first_with_dup, SHARD_2: second}, weight_map)
    with pytest.raises(
        ValueError, match=f"tensor {re.escape(duplicated)} appears in more than one shard"
    ):
        LLM(model=str(folder))


@pytest.mark.parametrize("weight_map", [{}, None, ["a"]])
def test_index_without_weight_map(tmp_path, weight_map):
    folder = tmp_path / "m"
    folder.mkdir()
    write_config(folder)
    index: dict[str, Any] = {"metadata": {}}
    if weight_map is not None:
        index["weight_map"] = weight_map
    (folder / INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(ValueError, match="missing or empty 'weight_map'"):
        LLM(model=str(folder))
