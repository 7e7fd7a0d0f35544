"""K/V cache scales of a float8 KV cache: read from an FP8 checkpoint (one per tensor or
one per KV head, under vLLM's names), applied by the reference ops on write and read,
sharded with the heads, ignored by a cache in the model's dtype; static activation scales
are checked and dropped."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from tests.conftest import drain
from tests.unit.test_fp8 import fp8_toy_checkpoint
from vllm_rlt import LLM, SamplingParams
from vllm_rlt.layers.fp8 import FP8_DTYPE, FP8_MAX
from vllm_rlt.models.fp8_checkpoint import PROJECTION_WEIGHTS
from vllm_rlt.models.loader import SINGLE_FILE, load_model
from vllm_rlt.parallel.tensor_parallel import TensorParallel

LAYERS, KV_HEADS = 2, 2  # the toy's


def _checkpoint(
    folder, extra: dict, scheme: str = "dynamic", static: bool = False, shrink: tuple = ()
) -> dict:
    """The toy as a per-tensor FP8 checkpoint plus `extra` tensors; returns its tensors."""
    spec = {"quant_method": "fp8", "activation_scheme": scheme}
    return fp8_toy_checkpoint(folder, False, spec, extra, shrink, input_scales=static)


def _kv_scales(k_values, v_values, names=("self_attn.k_scale", "self_attn.v_scale")) -> dict:
    out = {}
    for layer in range(LAYERS):
        out[f"model.layers.{layer}.{names[0]}"] = torch.tensor(k_values)
        out[f"model.layers.{layer}.{names[1]}"] = torch.tensor(v_values)
    return out


@pytest.mark.parametrize(
    ("k_values", "v_values", "names"),
    [
        (0.5, 0.25, ("self_attn.k_scale", "self_attn.v_scale")),
        ([0.5, 2.0], [0.125, 4.0], ("self_attn.k_scale", "self_attn.v_scale")),
        (2.0, 0.5, ("self_attn.k_proj.output_scale", "self_attn.v_proj.output_scale")),
    ],
    ids=["per_tensor", "per_head", "output_scale"],
)
def test_a_checkpoints_kv_scales_divide_what_the_fp8_cache_holds(
    tmp_path, make_engine, k_values, v_values, names
):
    """Each layer gets [kv_heads] scales; loop 0 of layer 0 writes K/V computed from the
    embeddings alone, so plane 0 of the float8 pool holds exactly the model-dtype pool's
    plane 0 divided by the head's scale and rounded."""
    _checkpoint(tmp_path, _kv_scales(k_values, v_values, names))
    model = load_model(tmp_path, torch.float32, "cpu")
    k_want = torch.tensor(k_values).float().expand(KV_HEADS)
    v_want = torch.tensor(v_values).float().expand(KV_HEADS)
    for layer in model.layers:
        assert torch.equal(layer.kv_scales[0], k_want)
        assert torch.equal(layer.kv_scales[1], v_want)
    prompt, params = list(b"347+589="), SamplingParams(max_tokens=1, temperature=0.0)
    pools = []
    for kv_dtype in ("auto", "fp8"):
        engine = make_engine(num_blocks=16, kv_cache_dtype=kv_dtype, model=model)
        drain(engine, {0: [("a", prompt, params)]})
        pools.append(engine.runner.kv_pool)
    plain, fp8 = pools
    plane = plain.slots_per_plane - plain.block_size
    for ours, theirs, scale in ((fp8.k[0], plain.k[0], k_want), (fp8.v[0], plain.v[0], v_want)):
        assert theirs[:plane].any()
        rounded = (theirs[:plane] / scale[:, None]).to(FP8_DTYPE)
        assert torch.equal(ours[:plane].view(torch.uint8), rounded.view(torch.uint8))


def test_scales_keep_small_keys_and_values_out_of_float8s_coarse_range(tmp_path):
    """With k_proj and v_proj shrunk a thousandfold, K and V sit near float8 e4m3's
    subnormal range (below 2^-6) and lose most of their bits at scale 1; with scales of
    1/2048 they keep three mantissa bits, so the prompt's logprobs come many times
    closer to those over a float32 cache (about 40 times here)."""
    small = ("self_attn.k_proj.weight", "self_attn.v_proj.weight")
    _checkpoint(tmp_path / "unit", {}, shrink=small)
    _checkpoint(tmp_path / "scaled", _kv_scales(1 / 2048, 1 / 2048), shrink=small)
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    prompt = list(b"the quick brown fox jumps over the lazy dog")

    def logprobs(folder: str, kv_dtype: str) -> torch.Tensor:
        llm = LLM(model=str(tmp_path / folder), kv_cache_dtype=kv_dtype)
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        return torch.tensor(
            [
                entry[token].logprob
                for entry, token in zip(out.prompt_logprobs[1:], prompt[1:], strict=True)
            ]
        )

    exact = logprobs("unit", "auto")
    unit_error = (logprobs("unit", "fp8") - exact).abs().mean()
    scaled_error = (logprobs("scaled", "fp8") - exact).abs().mean()
    assert scaled_error * 10 < unit_error, (scaled_error, unit_error)


def fp8_copy_of_the_built_in_model(folder, k_scale: float, v_scale: float) -> None:
    """The built-in model as an FP8 checkpoint (per-tensor weight scales) with one K and
    one V scale per layer, for runs on any device."""
    from vllm_rlt.models.load import DEFAULT_MODEL_DIR as assets

    folder.mkdir(parents=True, exist_ok=True)
    for name in assets.iterdir():
        if name.suffix == ".json" and name.name != "config.json":
            (folder / name.name).write_bytes(name.read_bytes())
    config = json.loads((assets / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    (folder / "config.json").write_text(json.dumps(config))
    tensors = {}
    with safe_open(str(assets / SINGLE_FILE), framework="pt") as handle:
        for name in handle.keys():
            weight = handle.get_tensor(name)
            if name.endswith(PROJECTION_WEIGHTS):
                scale = (weight.abs().amax().float() / FP8_MAX).reshape(())
                tensors[name + "_scale"] = scale
                weight = (weight.float() / scale).to(FP8_DTYPE)
            tensors[name] = weight
    for layer in range(config["num_hidden_layers"]):
        tensors[f"model.layers.{layer}.self_attn.k_scale"] = torch.tensor(k_scale)
        tensors[f"model.layers.{layer}.self_attn.v_scale"] = torch.tensor(v_scale)
    save_file(tensors, str(folder / SINGLE_FILE))


def test_the_built_in_model_answers_from_an_fp8_checkpoint_with_kv_scales(tmp_path):
    fp8_copy_of_the_built_in_model(tmp_path, 0.25, 4.0)
    scales = load_model(tmp_path, torch.float32, "cpu").layers[0].kv_scales
    assert {t.unique().item() for t in scales} == {0.25, 4.0}
    llm = LLM(model=str(tmp_path), kv_cache_dtype="fp8")
    params = SamplingParams(max_tokens=8, temperature=0.0)
    outputs = llm.generate(["347+589=", "123+456=", "812-345="], params, use_tqdm=False)
    assert [o.outputs[0].text for o in outputs] == ["936", "579", "467"]


def test_kv_scales_are_dropped_under_a_cache_in_the_model_dtype(tmp_path):
    """A float32 cache ignores the scales: the same tokens and depths as without them."""
    _checkpoint(tmp_path / "with", _kv_scales(0.5, 0.25))
    _checkpoint(tmp_path / "without", {})
    params = SamplingParams(max_tokens=8, temperature=0.0, exit_threshold=0.5)
    results = [
        [
            (o.outputs[0].token_ids, o.outputs[0].exit_depths)
            for o in LLM(model=str(tmp_path / f)).generate([list(b"hello")], params)
        ]
        for f in ("with", "without")
    ]
    assert results[0] == results[1]


def test_static_activation_scales_are_checked_and_left_unused(tmp_path):
    """activation_scheme static loads: the input scales are dropped (activations are scaled
    per token), so the model generates as the dynamic checkpoint does."""
    _checkpoint(tmp_path / "static", {}, scheme="static", static=True)
    _checkpoint(tmp_path / "dynamic", {})
    params = SamplingParams(max_tokens=8, temperature=0.0)
    texts = [
        LLM(model=str(tmp_path / f)).generate([list(b"ab")], params)[0].outputs[0].token_ids
        for f in ("static", "dynamic")
    ]
    assert texts[0] == texts[1]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (
            {"model.layers.0.self_attn.k_scale": torch.tensor(1.0)},
            r"only one of model.layers.0.self_attn.k_scale and model.layers.0.self_attn.v_scale",
        ),
        (
            {
                "model.layers.0.self_attn.k_scale": torch.tensor(1.0),
                "model.layers.0.self_attn.v_scale": torch.tensor(1.0),
            },
            r"lacks K/V scales of layers \[1\]",
        ),
        (
            _kv_scales([1.0, 1.0, 1.0], 1.0),
            r"self_attn.k_scale holds 3 scales for 2 KV heads",
        ),
        (_kv_scales(0.0, 1.0), r"k_scale must hold finite scales > 0"),
        (_kv_scales(1.0, float("nan")), r"v_scale must hold finite scales > 0"),
        (
            {
                **_kv_scales(1.0, 1.0),
                **_kv_scales(1.0, 1.0, ("self_attn.k_proj.output_scale", "self_attn.v_scale")),
            },
            r"K/V scales of layer 0 under two names",
        ),
        (
            {"model.layers.0.self_attn.o_proj.input_scale": torch.tensor(-1.0)},
            r"o_proj.input_scale must hold finite scales > 0",
        ),
        ({"model.layers.0.self_attn.q_scale": torch.tensor(1.0)}, r"unexpected tensors"),
        (
            {"model.norm.weight": torch.ones(64, dtype=FP8_DTYPE)},
            r"\['model.norm.weight'\] are float8 \(only projections may be\)",
        ),
    ],
    ids=[
        "one_of_two",
        "some_layers",
        "head_count",
        "zero",
        "nan",
        "two_names",
        "input",
        "q",
        "float8_norm",
    ],
)
def test_bad_kv_and_activation_scales_are_named(tmp_path, extra, message):
    _checkpoint(tmp_path, extra)
    with pytest.raises(ValueError, match=message):
        load_model(tmp_path, torch.float32, "cpu")


def test_float8_tensors_without_a_quantization_config_are_named(tmp_path):
    from vllm_rlt.models.toy import toy_config_dict

    tensors = _checkpoint(tmp_path, {})
    (tmp_path / "config.json").write_text(json.dumps(toy_config_dict()))
    save_file(
        {n: t for n, t in tensors.items() if not n.endswith("_scale")}, str(tmp_path / SINGLE_FILE)
    )
    with pytest.raises(ValueError, match=r"are float8, but config.json has no quantization_config"):
        load_model(tmp_path, torch.float32, "cpu")


def test_tensor_parallel_ranks_keep_their_heads_scales(tmp_path):
    _checkpoint(tmp_path, _kv_scales([0.5, 2.0], [0.125, 4.0]))
    model = load_model(tmp_path, torch.float32, "cpu")
    model.shard(TensorParallel(rank=1, world=2, device_group=None, control_group=None))
    for layer in model.layers:
        assert layer.kv_scales[0].tolist() == [2.0] and layer.kv_scales[1].tolist() == [4.0]
