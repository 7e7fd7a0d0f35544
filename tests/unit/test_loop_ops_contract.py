"""The ops contract (ops/base.py): every backend has each op of LoopOps with its parameters.
The Triton backend needs triton to import, so its class is read from the source."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest
import torch

from vllm_rlt.ops.base import LoopOps
from vllm_rlt.ops.registry import get_backend
from vllm_rlt.ops.torch_ops import TorchOps

OPS_FOLDER = Path(inspect.getfile(LoopOps)).parent


def _contract_methods() -> dict[str, list[str]]:
    """Each op of the contract and its parameter names."""
    return {
        name: list(inspect.signature(member).parameters)
        for name, member in vars(LoopOps).items()
        if not name.startswith("_") and callable(member)
    }


def test_the_contract_names_every_op_a_loop_runs():
    assert set(_contract_methods()) == {
        "prefill_tile_rows",
        "rms_norm",
        "add_rms_norm2",
        "linear_add_rms_norm2",
        "linear",
        "linear_silu_mul",
        "sample_plain",
        "token_stats",
        "sample_filtered",
        "attention",
    }
    assert "needs_segments" in LoopOps.__annotations__


def test_the_torch_backend_keeps_the_contract():
    ops = TorchOps()
    assert isinstance(ops, LoopOps)
    for name, parameters in _contract_methods().items():
        assert list(inspect.signature(getattr(TorchOps, name)).parameters) == parameters, name


def test_the_triton_backend_keeps_the_contract():
    tree = ast.parse((OPS_FOLDER / "triton_ops.py").read_text())
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "TritonOps"]
    methods = {
        node.name: [arg.arg for arg in node.args.args]
        for node in cls.body
        if isinstance(node, ast.FunctionDef)
    }
    attributes = {
        target.id
        for node in cls.body
        if isinstance(node, ast.Assign)
        for target in node.targets
        if isinstance(target, ast.Name)
    }
    assert "needs_segments" in attributes
    for name, parameters in _contract_methods().items():
        assert methods.get(name) == parameters, name


def test_the_registry_gives_ops_that_keep_the_contract():
    name, ops = get_backend("auto", torch.device("cpu"))
    assert name == "torch" and isinstance(ops, LoopOps)


def test_backends_say_which_head_sizes_they_take(monkeypatch):
    """The Triton kernels take any even head size (Huginn's 96 too) and no odd one, whose
    halves RoPE could not rotate: "auto" passes over a backend that does not take a head
    size, and naming it is an error that says so."""
    from vllm_rlt.ops import registry

    *_, even_sizes, takes_fp8 = registry._BACKENDS["triton"]
    even = (lambda device: True, registry._BACKENDS["torch"][1], even_sizes, takes_fp8)
    monkeypatch.setattr(registry, "_BACKENDS", {"even": even} | registry._BACKENDS)
    cpu = torch.device("cpu")
    for head_dim in (64, 80, 96, 112, 128, 256):
        assert registry.get_backend("auto", cpu, head_dim)[0] == "even"
    assert registry.get_backend("auto", cpu, 95)[0] == "torch"
    with pytest.raises(ValueError, match="does not take head size 95"):
        registry.get_backend("even", cpu, 95)


def test_float8_on_a_gpu_without_float8_kernels_is_an_error_naming_the_setting(monkeypatch):
    """The Triton backend takes float8 e4m3 from compute capability 8.9: on an older GPU a
    run that asks for fp8 weights or K/V is refused with the setting's name and the way
    out, instead of failing inside a kernel's compilation; the torch backend takes it."""
    from vllm_rlt.config import ParamError
    from vllm_rlt.ops import registry

    loads = registry._BACKENDS["torch"][1]
    fake = (lambda device: True, loads, registry._BACKENDS["triton"][2], registry._triton_takes_fp8)
    monkeypatch.setattr(registry, "_BACKENDS", {"fake": fake} | registry._BACKENDS)
    cpu = torch.device("cpu")
    for capability, refused in (((8, 0), True), ((8, 6), True), ((8, 9), False), ((9, 0), False)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d, c=capability: c)
        for setting in ("quantization", "kv_cache_dtype"):
            if refused:
                with pytest.raises(ParamError, match=f"^{setting}: float8 e4m3 needs") as error:
                    registry.get_backend("auto", cpu, 64, setting)
                assert error.value.param == setting
                assert f"GPU is {capability[0]}.{capability[1]}" in str(error.value)
            else:
                assert registry.get_backend("auto", cpu, 64, setting)[0] == "fake"
        assert registry.get_backend("auto", cpu, 64)[0] == "fake"  # bf16: any capability
        assert registry.get_backend("torch", cpu, 64, "quantization")[0] == "torch"
    # a backend the device lacks is that error first (no capability is asked of a CPU)
    with pytest.raises(ValueError, match="'triton' is not available on device 'cpu'"):
        registry.get_backend("triton", cpu, 64, "quantization")


def test_token_stats_give_the_logprob_and_rank_of_the_token():
    """The greedy form takes the first maximum (as argmax); a rank counts the token and every
    token at least as likely; masked (-inf) tokens never count."""
    logits = torch.tensor([[1.0, 3.0, 3.0, float("-inf")], [0.5, -1.0, 2.0, 2.0]])
    tokens, logprobs, ranks = TorchOps().token_stats(logits, None)
    assert tokens.tolist() == [1, 2] and ranks.tolist() == [2, 2]
    torch.testing.assert_close(logprobs, logits.log_softmax(-1)[[0, 1], [1, 2]])
    given = torch.tensor([0, 1])
    tokens, logprobs, ranks = TorchOps().token_stats(logits, given)
    assert tokens is given and ranks.tolist() == [3, 4]
    torch.testing.assert_close(logprobs, logits.log_softmax(-1)[[0, 1], [0, 1]])
