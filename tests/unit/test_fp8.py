"""FP8 weights on the CPU: the quantization's error bound, in-place row views, the engine's
fp8 path against the same model holding the dequantized weights, `load_weights` into an
fp8 model, and the bad values of the setting."""

from __future__ import annotations

import argparse
import json

import pytest
import torch
from safetensors.torch import save_file

from tests.conftest import drain
from vllm_rlt import LLM, CacheConfig, SamplingParams
from vllm_rlt.engine.trainer_hooks import weight_tensors
from vllm_rlt.entrypoints.args import add_engine_args, engine_args_from
from vllm_rlt.layers.fp8 import (
    FP8_DTYPE,
    FP8_MAX,
    Fp8Weight,
    fp8_linear_reference,
    weight_nbytes,
)
from vllm_rlt.models.fp8_checkpoint import PROJECTION_WEIGHTS
from vllm_rlt.models.loader import SINGLE_FILE, load_model
from vllm_rlt.models.ouro import OuroConfig, OuroModel
from vllm_rlt.models.ouro_layer import PROJECTIONS
from vllm_rlt.models.toy import toy_config_dict, toy_weights


def test_each_value_is_within_half_a_float8_step():
    """e4m3 keeps 3 mantissa bits: a normal value is off by at most 2^-4 of itself, a
    subnormal one (below 2^-6 of the row scale's range) by half of 2^-9 scale units."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(64, 96, generator=gen) * torch.logspace(-3, 1, 64)[:, None]
    w[5] = 0.0
    q = Fp8Weight.quantize(w)
    assert q.data.dtype == FP8_DTYPE and q.scale.dtype == torch.float32
    assert q.shape == w.shape and q.scale.shape == (64,)
    error = (q.dequantize(torch.float32) - w).abs()
    bound = torch.maximum(w.abs() * 2**-4, q.scale[:, None] * 2**-10)
    assert (error <= bound * (1 + 1e-6)).all()
    nonzero = torch.ones(64, dtype=torch.bool)
    nonzero[5] = False
    assert (q.data.float().abs().amax(dim=1)[nonzero] == FP8_MAX).all()  # the range is used
    assert (q.data[5].float() == 0).all() and q.scale[5] == 1.0


def test_row_views_quantize_into_the_same_storage():
    """A checkpoint tensor that is every other row of a fused weight (gate or up) takes new
    values in place: its rows get new scales, the other rows keep theirs."""
    gen = torch.Generator().manual_seed(1)
    q = Fp8Weight.quantize(torch.randn(8, 32, generator=gen))
    data, scale, even = q.data.data_ptr(), q.scale.clone(), q.data[0::2].clone()
    new = 10 * torch.randn(4, 32, generator=gen)
    q[1::2].copy_(new)
    assert q.data.data_ptr() == data
    torch.testing.assert_close(q[1::2].dequantize(torch.float32), new, rtol=2**-4, atol=0.0)
    assert torch.equal(q.data[0::2].float(), even.float())
    assert torch.equal(q.scale[0::2], scale[0::2])


@pytest.fixture(scope="module")
def fp8_toy(toy_config, toy_state) -> OuroModel:
    model = OuroModel(OuroConfig.from_dict(toy_config), toy_state, torch.float32, "cpu")
    model.quantize("fp8")
    return model


def test_quantized_layers_hold_half_the_bytes_or_less(fp8_toy, toy_model):
    for quantized, plain in zip(fp8_toy.layers, toy_model.layers, strict=True):
        for name in PROJECTIONS:
            weight = getattr(quantized, name)
            assert isinstance(weight, Fp8Weight)
            # one byte per value instead of four (float32 here), plus a scale per row
            assert weight_nbytes(weight) * 4 < weight_nbytes(getattr(plain, name)) * 1.1
    assert fp8_toy.lm_head.dtype == torch.float32 and fp8_toy.gate_weight.dtype == torch.float32
    dtypes = {t.dtype for t in weight_tensors(fp8_toy)}
    assert dtypes == {FP8_DTYPE, torch.float32}  # sleep mode moves the fp8 storages too


def test_the_engine_computes_with_the_dequantized_weights(
    make_engine, fp8_toy, toy_config, toy_state
):
    """The fp8 path (products scaled per output column) gives the tokens and exit depths
    of an unquantized model that holds the dequantized weights, and logprobs equal up to
    float32 rounding: every projection takes its fp8 weight and scale, nothing else."""
    twin = OuroModel(OuroConfig.from_dict(toy_config), toy_state, torch.float32, "cpu")
    for layer, quantized in zip(twin.layers, fp8_toy.layers, strict=True):
        for name in PROJECTIONS:
            setattr(layer, name, getattr(quantized, name).dequantize(torch.float32))
    prompts = [list(b"347+589="), list(b"hello loops"), list(b"x")]
    params = SamplingParams(max_tokens=12, temperature=0.0, logprobs=2, exit_threshold=0.5)
    outputs = []
    for model in (fp8_toy, twin):
        engine = make_engine(model=model)
        arrivals = {0: [(str(i), ids, params) for i, ids in enumerate(prompts)]}
        outputs.append(drain(engine, arrivals))
    for request_id, got in outputs[0].items():
        want = outputs[1][request_id].outputs[0]
        assert got.outputs[0].token_ids == want.token_ids
        assert got.outputs[0].exit_depths == want.exit_depths
        for a, b in zip(got.outputs[0].logprobs, want.logprobs, strict=True):
            assert a.keys() == b.keys()
            assert all(abs(a[t].logprob - b[t].logprob) < 1e-4 for t in a)


def test_the_built_in_model_still_answers_and_takes_new_weights():
    """LLM(quantization="fp8") on the built-in model answers its arithmetic; load_weights
    quantizes what it is given, so loading the original weights back restores the outputs
    exactly (same values and scales)."""
    llm = LLM(quantization="fp8")
    params = SamplingParams(max_tokens=8, temperature=0.0)
    prompts = ["347+589=", "12*34=", "sort 9 3 7 1 ="]
    first = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert llm.generate(["347+589="], params, use_tqdm=False)[0].outputs[0].text == "936"
    views = llm.engine.model.checkpoint_views()
    original = {
        name: view.dequantize(torch.float32) if isinstance(view, Fp8Weight) else view.clone()
        for name, view in views.items()
    }
    llm.load_weights(
        (name, torch.zeros_like(t) if "mlp.up_proj" in name else t) for name, t in original.items()
    )
    changed = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert changed != first
    llm.load_weights(original.items())
    again = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert again == first


def test_bad_values_name_the_field():
    with pytest.raises(ValueError, match=r"quantization must be one of fp8 or None.*'int4'"):
        LLM(model="toy", quantization="int4")
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    ns = parser.parse_args(["--model", "toy", "--quantization", "fp8"])
    assert engine_args_from(ns).create_engine_config().model_config.quantization == "fp8"
    assert parser.parse_args(["--model", "toy"]).quantization is None


def test_the_reference_product_scales_each_output_column():
    q = Fp8Weight.quantize(toy_weights()["model.layers.0.mlp.down_proj.weight"])
    x = torch.randn(3, q.shape[1], generator=torch.Generator().manual_seed(2))
    expected = x @ q.dequantize(torch.float32).T
    torch.testing.assert_close(fp8_linear_reference(x, q), expected, rtol=1e-5, atol=1e-5)


def test_fp8_kv_cache_holds_more_positions_in_the_same_bytes():
    budget = 1 << 20
    pools = {}
    for kv_dtype in ("auto", "fp8", "fp8_e5m2"):
        llm = LLM(
            model="toy",
            cache_config=CacheConfig(kv_cache_memory_bytes=budget, kv_cache_dtype=kv_dtype),
        )
        runner = llm.engine.runner
        pools[kv_dtype] = (runner.k_caches[0].dtype, llm.engine.kv.num_blocks)
    assert pools["fp8"][0] == torch.float8_e4m3fn and pools["fp8_e5m2"][0] == torch.float8_e5m2
    # one byte per value instead of four (the toy runs in float32)
    assert pools["fp8"][1] == pools["fp8_e5m2"][1] >= 3.9 * pools["auto"][1]


def test_fp8_kv_cache_stores_the_rounded_keys_and_values(make_engine):
    """Loop 0 of layer 0 writes K and V computed from the embeddings alone, so plane 0 of
    the fp8 pool holds exactly the unquantized pool's plane 0 rounded to float8 (entries
    never written are zero in both; the dummy block after the pool's blocks, which padding
    rows write, is left out)."""
    prompt = list(b"347+589=")
    params = SamplingParams(max_tokens=1, temperature=0.0)
    pools = []
    for kv_dtype in ("auto", "fp8"):
        engine = make_engine(num_blocks=16, kv_cache_dtype=kv_dtype)
        drain(engine, {0: [("a", prompt, params)]})
        pools.append(engine.runner.kv_pool)
    plain, fp8 = pools
    plane = plain.slots_per_plane - plain.block_size
    for ours, theirs in ((fp8.k[0], plain.k[0]), (fp8.v[0], plain.v[0])):
        assert ours.dtype == torch.float8_e4m3fn
        assert theirs[:plane].any()
        rounded = theirs[:plane].to(torch.float8_e4m3fn)
        assert torch.equal(ours[:plane].view(torch.uint8), rounded.view(torch.uint8))
        assert not torch.equal(ours[:plane].float(), theirs[:plane])  # it did round


def test_the_built_in_model_answers_with_every_fp8_setting():
    params = SamplingParams(max_tokens=8, temperature=0.0)
    prompts = ["347+589=", "123+456=", "812-345="]
    for quantization, kv_dtype in ((None, "fp8"), ("fp8", "fp8"), ("fp8", "fp8_e5m2")):
        llm = LLM(quantization=quantization, kv_cache_dtype=kv_dtype)
        outputs = llm.generate(prompts, params, use_tqdm=False)
        assert [o.outputs[0].text for o in outputs] == ["936", "579", "467"]


def fp8_toy_checkpoint(
    folder,
    per_channel: bool,
    quantization_config=None,
    extra: dict | None = None,
    shrink: tuple[str, ...] = (),
    input_scales: bool = False,
) -> dict:
    """The toy as an FP8 checkpoint in vLLM's layout: float8 projections beside their
    weight_scale (one per tensor, or one per output channel), with `extra` tensors, the
    weights named by a suffix in `shrink` divided by 1000 and, with `input_scales`, a
    static input_scale per projection; returns its tensors."""
    folder.mkdir(parents=True, exist_ok=True)
    config = {
        **toy_config_dict(),
        "quantization_config": quantization_config
        or {"quant_method": "fp8", "activation_scheme": "dynamic"},
    }
    (folder / "config.json").write_text(json.dumps(config))
    tensors = {}
    for name, weight in toy_weights().items():
        if not name.endswith(PROJECTION_WEIGHTS):
            tensors[name] = weight
            continue
        if name.endswith(shrink):
            weight = weight / 1000
        amax = weight.abs().amax(dim=1, keepdim=True) if per_channel else weight.abs().amax()
        scale = (amax / FP8_MAX).float()
        tensors[name] = (weight / scale).to(FP8_DTYPE)
        tensors[name + "_scale"] = scale if per_channel else scale.reshape(())
        if input_scales:
            tensors[name.removesuffix("weight") + "input_scale"] = torch.tensor(0.02)
    tensors.update(extra or {})
    save_file(tensors, str(folder / SINGLE_FILE))
    return tensors


@pytest.mark.parametrize("per_channel", [False, True], ids=["per_tensor", "per_channel"])
def test_an_fp8_checkpoint_keeps_its_values_and_scales(tmp_path, per_channel):
    """Every projection holds the checkpoint's float8 bytes and its scales (a tensor's one
    scale on each of its rows), fused as the model fuses them; the model then computes
    as one holding the dequantized weights."""
    tensors = fp8_toy_checkpoint(
        tmp_path / "ckpt",
        per_channel,
        {"quant_method": "fp8", "activation_scheme": "dynamic", "ignored_layers": ["lm_head"]},
    )
    model = load_model(tmp_path / "ckpt", torch.float32, "cpu")
    # its own storage, not the file's, so that sleep mode can release it
    assert all(weight.untyped_storage().resizable() for weight in weight_tensors(model))
    assert model.quantization == "fp8"
    layer, prefix = model.layers[1], "model.layers.1."

    def rows(name: str) -> torch.Tensor:
        scale = tensors[prefix + name + "_scale"].float().reshape(-1)
        return scale.expand(tensors[prefix + name].shape[0])

    q, k, v = (f"self_attn.{p}_proj.weight" for p in "qkv")
    assert torch.equal(
        layer.qkv.data.view(torch.uint8),
        torch.cat([tensors[prefix + n].view(torch.uint8) for n in (q, k, v)]),
    )
    assert torch.equal(layer.qkv.scale, torch.cat([rows(n) for n in (q, k, v)]))
    gate, up = "mlp.gate_proj.weight", "mlp.up_proj.weight"
    assert torch.equal(
        layer.gate_up.data[0::2].view(torch.uint8), tensors[prefix + gate].view(torch.uint8)
    )
    assert torch.equal(layer.gate_up.scale[1::2], rows(up))
    down = "mlp.down_proj.weight"
    assert torch.equal(layer.down.data.view(torch.uint8), tensors[prefix + down].view(torch.uint8))
    assert torch.equal(layer.down.scale, rows(down))
    # Generation: the same as the toy with the dequantized weights.
    plain = {n: t for n, t in tensors.items() if not n.endswith("_scale")}
    for name in plain:
        if name.endswith(PROJECTION_WEIGHTS):
            scale = tensors[name + "_scale"].float()
            plain[name] = plain[name].float() * (scale if per_channel else scale.reshape(1, 1))
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "config.json").write_text(json.dumps(toy_config_dict()))
    save_file(plain, str(tmp_path / "plain" / SINGLE_FILE))
    params = SamplingParams(max_tokens=8, temperature=0.0, exit_threshold=0.5)
    prompts = [list(b"hello"), list(b"ab")]
    got, want = (
        [
            (o.outputs[0].token_ids, o.outputs[0].exit_depths)
            for o in LLM(model=str(tmp_path / f)).generate(prompts, params, use_tqdm=False)
        ]
        for f in ("ckpt", "plain")
    )
    assert got == want


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"quant_method": "awq"}, r"quant_method must be 'fp8'.*'awq'"),
        (
            {"quant_method": "fp8", "activation_scheme": "per_block"},
            r"activation_scheme must be 'dynamic' or 'static'.*'per_block'",
        ),
        (
            {"quant_method": "fp8", "weight_block_size": [128, 128]},
            r"weight_block_size is not supported",
        ),
        ({"quant_method": "fp8", "kv_cache_scheme": {}}, r"unsupported quantization_config keys"),
        (
            {"quant_method": "fp8", "ignored_layers": ["lm_head", "model.layers.0.mlp.down_proj"]},
            r"ignored_layers may name only lm_head and embed_tokens.*down_proj",
        ),
    ],
)
def test_fp8_checkpoints_this_engine_cannot_read_are_named(tmp_path, spec, message):
    fp8_toy_checkpoint(tmp_path, False, spec)
    with pytest.raises(ValueError, match=message):
        load_model(tmp_path, torch.float32, "cpu")


def test_an_fp8_checkpoint_with_a_wrong_scale_is_named(tmp_path):
    tensors = fp8_toy_checkpoint(tmp_path, False)
    name = "model.layers.0.self_attn.o_proj.weight_scale"
    tensors[name] = torch.ones(3)
    save_file(tensors, str(tmp_path / SINGLE_FILE))
    with pytest.raises(ValueError, match=rf"{name} holds 3 scales for \d+ output channels"):
        load_model(tmp_path, torch.float32, "cpu")
    del tensors[name]
    save_file(tensors, str(tmp_path / SINGLE_FILE))
    with pytest.raises(ValueError, match=rf"missing tensors: {name}"):
        load_model(tmp_path, torch.float32, "cpu")


def test_sleep_mode_gives_back_the_float8_storages_and_keeps_outputs():
    llm = LLM(model="toy", quantization="fp8", kv_cache_dtype="fp8", enable_sleep_mode=True)
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompts = [[5, 6, 7, 8] * 5, [9, 10]]

    def tokens():
        return [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]

    want = tokens()
    qkv, kv = llm.engine.model.layers[0].qkv, llm.engine.runner.k_caches[0]
    llm.sleep(level=1)
    assert qkv.data.untyped_storage().nbytes() == 0 and kv.untyped_storage().nbytes() == 0
    llm.wake_up()
    assert tokens() == want
    llm.sleep(level=2)
    llm.wake_up()
    llm.load_weights(toy_weights().items())  # quantized again into the same storage
    assert llm.engine.model.layers[0].qkv.data is qkv.data
    assert tokens() == want


def test_the_reference_product_does_not_overflow_in_float16():
    """The float8 values reach 448 before their scale: summed in float16 they overflow,
    where the scaled product is small."""
    weight = torch.zeros(8, 64)
    weight[:, 0] = 1.0
    weight[:, 1:] = 1e-3
    q = Fp8Weight.quantize(weight)
    x = torch.zeros(2, 64, dtype=torch.float16)
    x[:, 0] = 200.0
    got = fp8_linear_reference(x, q)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(
        got.float(), x.float() @ q.dequantize(torch.float32).T, rtol=1e-3, atol=1e-2
    )
