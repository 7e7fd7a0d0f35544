"""benchmarks/fp8_quality.py on the toy shape: one JSON line per variant, and rounding the
activations per token (the FP8 tensor-core path) moves the outputs beyond weight-only fp8."""

from __future__ import annotations

import json
import math

import torch

from benchmarks.fp8_quality import VARIANTS, PerTokenFp8Ops, main
from vllm_rlt.layers.fp8 import Fp8Weight
from vllm_rlt.ops.torch_ops import TorchOps


def test_each_variant_is_reported(capsys):
    argv = ["--shape", "toy", "--dtype", "float32", "--prompts", "1", "--prompt-len", "8"]
    assert main(argv) == 0
    records = {r["variant"]: r for r in map(json.loads, capsys.readouterr().out.splitlines())}
    # the engine-kernel variants run on a GPU only
    on_cpu = [n for n, v in VARIANTS.items() if v[3] != "kernels" and v[1] != "kernel"]
    assert list(records) == on_cpu
    for record in records.values():
        assert math.isfinite(record["mean_kl"]) and record["mean_kl"] >= 0
        assert 0 <= record["top1_agreement"] <= 1
    weights_only = records["fp8 weights"]["mean_kl"]
    assert records["fp8 weights, activations per token"]["mean_kl"] != weights_only


def test_per_token_rounding_keeps_each_rows_largest_value():
    """Each row's largest magnitude maps to float8's largest value, so it comes back
    exactly; a value far below it in the same row loses precision, alone in its row it
    does not."""
    x = torch.tensor([[3.0, 0.01234], [0.01234, 0.0]])
    weight = Fp8Weight(torch.eye(2).to(torch.float8_e4m3fn), torch.ones(2))
    got = PerTokenFp8Ops().linear(x, weight)
    assert got[0, 0] == x[0, 0] and got[1, 0] == x[1, 0]
    assert got[0, 1] != x[0, 1]
    torch.testing.assert_close(TorchOps().linear(x, weight), x)


def test_accuracy_runs_through_the_per_token_product(monkeypatch, capsys):
    """benchmarks/fp8_activation_accuracy.py: bench accuracy's report, with every fp8
    projection of the engine computed by the per-token product."""
    import benchmarks.fp8_activation_accuracy as tool

    calls, product = [], tool.per_token_fp8_product

    def counted(x, weight):
        calls.append(x.shape[0])
        return product(x, weight)

    monkeypatch.setattr(tool, "per_token_fp8_product", counted)
    argv = ["--per-task", "1", "--train-size", "0", "--thresholds", "0.5", "--quantization", "fp8"]
    assert tool.main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["quantization"] == "fp8" and report["rows"]
    assert calls
