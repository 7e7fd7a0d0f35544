"""The CUDA C++ kernels (kernels/csrc/) against torch, on a GPU with nvcc: the few-row
products, float8 and bf16 weights, at edge row counts and shapes, with and without their
SiLU-mul epilogue, inside a CUDA graph, and the engine's dispatch to them; and the
fall-back to Triton, with one log line, where no compiler is found."""

from __future__ import annotations

import logging

import pytest
import torch

from vllm_rlt.kernels import cuda_build, few_row_gemm
from vllm_rlt.layers.fp8 import Fp8Weight
from vllm_rlt.ops.torch_ops import TorchOps

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
if cuda_build.find_nvcc() is None:
    pytest.skip("needs nvcc to build the CUDA kernels", allow_module_level=True)

TOL = 2e-2  # bf16 outputs of sums in another order


def _problem(rows: int, n: int, k: int, seed: int, kind: str = "fp8"):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(rows, k, device="cuda", generator=gen).to(torch.bfloat16)
    w = torch.randn(n, k, device="cuda", generator=gen) / k**0.5
    w[0, :64] = 0.0  # zeros and float8 subnormals widen exactly too
    w[1, :64] = torch.linspace(-1e-3, 1e-3, 64, device="cuda")
    if kind == "bf16":
        weight = w.to(torch.bfloat16)
        dense = weight.float()
    else:
        weight = Fp8Weight.quantize(w.to(torch.bfloat16))
        dense = weight.dequantize(torch.float32)
    want = (x.float() @ dense.T).to(torch.bfloat16)
    return x, weight, want


@pytest.mark.parametrize("kind", ["fp8", "bf16"])
@pytest.mark.parametrize("rows", [1, 3, 8, 9, 16])
@pytest.mark.parametrize("n,k", [(2048, 2048), (6144, 2048), (2048, 5632), (16, 64), (48, 192)])
def test_few_row_gemm_against_torch(rows, n, k, kind):
    x, weight, want = _problem(rows, n, k, seed=rows * 7 + n + k, kind=kind)
    assert few_row_gemm.fits_few_row(x, weight)
    got = few_row_gemm.few_row_gemm(x, weight)
    torch.testing.assert_close(got, want, atol=TOL, rtol=TOL)
    # The epilogue against the torch ops on the kernel's own product.
    silu = TorchOps().silu_mul(got)
    fused = few_row_gemm.few_row_gemm(x, weight, silu_mul=True)
    torch.testing.assert_close(fused, silu, atol=TOL, rtol=TOL)


@pytest.mark.parametrize("kind", ["fp8", "bf16"])
@pytest.mark.parametrize("branch_norm", [True, False], ids=["norm_add_norm", "add_norm"])
@pytest.mark.parametrize("rows", [1, 3, 8, 9, 16])
@pytest.mark.parametrize("n,k", [(2048, 2048), (2048, 5632), (48, 192), (2064, 64)])
def test_few_row_gemm_add_norms_equals_the_product_then_the_norm_kernel(
    rows, n, k, kind, branch_norm
):
    """The last block's residual add and norms against TritonOps.add_rms_norm2 on the
    kernel's own product (the same rounding; sums in another order): a warp a row with the
    row in registers up to 2,048 wide, the whole block on a row past that (2,064). Replayed
    in a graph on fresh residuals, each replay must elect a last block again: the counters
    are back at zero after every launch."""
    from vllm_rlt.ops.triton_ops import TritonOps

    x, weight, _ = _problem(rows, n, k, seed=rows + n + k, kind=kind)
    gen = torch.Generator(device="cuda").manual_seed(rows)
    norms = (1 + 0.1 * torch.randn(2, n, device="cuda", generator=gen)).bfloat16()
    w_branch = norms[0] if branch_norm else None
    w_next = norms[1]
    ops = TritonOps()
    product = few_row_gemm.few_row_gemm(x, weight)

    def fresh_residual(seed: int) -> torch.Tensor:
        g = torch.Generator(device="cuda").manual_seed(seed)
        return torch.randn(rows, n, device="cuda", generator=g).to(torch.bfloat16)

    def check(got, residual):
        want = ops.add_rms_norm2(residual, product, w_branch, w_next, 1e-6)
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, atol=TOL, rtol=TOL)

    residual = fresh_residual(0)
    check(
        few_row_gemm.few_row_gemm_add_norms(residual, x, weight, w_branch, w_next, 1e-6), residual
    )
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = few_row_gemm.few_row_gemm_add_norms(
            residual, x, weight, w_branch, w_next, 1e-6, pdl=ops.pdl
        )
    for seed in (1, 2, 3):
        residual.copy_(fresh_residual(seed))
        graph.replay()
        check(captured, residual)
    torch.cuda.synchronize()
    counters = few_row_gemm.COUNTERS.counters(torch.device("cuda", torch.cuda.current_device()))
    assert int(counters.count_nonzero()) == 0


@pytest.mark.parametrize("kind", ["fp8", "bf16"])
def test_few_row_gemm_reads_strided_rows_and_replays_in_a_graph(kind):
    """Rows of a wider buffer (as a pass's persistent inputs are), captured in a graph and
    replayed on new values, with programmatic dependent launch."""
    buffer = torch.empty(16, 4096, device="cuda", dtype=torch.bfloat16)
    x, weight, _ = _problem(5, 2048, 2048, seed=3, kind=kind)
    view = buffer[:5, :2048]
    view.copy_(x)
    from vllm_rlt.ops.triton_ops import TritonOps

    pdl = TritonOps().pdl
    few_row_gemm.few_row_gemm(view, weight, pdl=pdl)  # built and loaded before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = few_row_gemm.few_row_gemm(view, weight, pdl=pdl)
    dense = weight.float() if kind == "bf16" else weight.dequantize(torch.float32)
    for seed in (4, 5):
        fresh, _, _ = _problem(5, 2048, 2048, seed=seed)
        view.copy_(fresh)
        graph.replay()
        want = (fresh.float() @ dense.T).to(torch.bfloat16)
        torch.testing.assert_close(out, want, atol=TOL, rtol=TOL)


@pytest.mark.parametrize("kind", ["fp8", "bf16"])
@pytest.mark.parametrize("rows", [1, 8, 16, 17])
def test_the_triton_ops_take_it_for_the_rows_it_is_set_for(rows, kind, monkeypatch):
    from vllm_rlt.ops.linear_plans import FP8_SKINNY_ROWS
    from vllm_rlt.ops.triton_ops import TritonOps

    monkeypatch.setattr(few_row_gemm, "FP8_CUDA_ROWS", 8 if kind == "fp8" else 0)
    monkeypatch.setattr(few_row_gemm, "BF16_CUDA_ROWS", 8 if kind == "bf16" else 0)
    x, weight, want = _problem(rows, 2048, 2048, seed=rows, kind=kind)
    assert few_row_gemm.takes_few_row(x, weight) == (rows <= 8)
    assert few_row_gemm.fits_few_row(x, weight) == (rows <= 16)

    def check(got: torch.Tensor, want: torch.Tensor) -> None:
        if kind == "bf16" or rows <= FP8_SKINNY_ROWS:
            torch.testing.assert_close(got, want, atol=TOL, rtol=TOL)
            return
        # W8A8: float8 activations too (3 mantissa bits), so the product is checked as a
        # whole (a wrong dispatch would be off by about 100%)
        error = (got.float() - want.float()).norm() / want.float().norm()
        assert error < 0.06, f"relative error {error:.3f}"

    check(TritonOps().linear(x, weight), want)
    check(TritonOps().linear_silu_mul(x, weight), TorchOps().silu_mul(want))
    residual, w_next = torch.ones_like(want), torch.ones(2048, device="cuda").bfloat16()
    x_out, _ = TritonOps().linear_add_rms_norm2(residual, x, weight, None, w_next, 1e-6)
    check(x_out - residual, (residual + want) - residual)  # the add, through either path
    assert not few_row_gemm.fits_few_row(x.float(), weight)  # bf16 activations only
    dense = weight.float() if kind == "bf16" else weight.dequantize(torch.float32)
    assert not few_row_gemm.fits_few_row(x, dense)  # bf16 or float8 weights only


def test_without_nvcc_the_triton_kernels_serve_after_one_log_line(monkeypatch, caplog):
    from vllm_rlt.ops.triton_ops import TritonOps

    monkeypatch.setattr(cuda_build, "find_nvcc", lambda: None)
    cuda_build.cuda_module.cache_clear()
    try:
        x, weight, want = _problem(1, 2048, 2048, seed=1)  # 1 row: weight-only fp8
        monkeypatch.setattr(few_row_gemm, "FP8_CUDA_ROWS", 16)
        with caplog.at_level(logging.WARNING, logger=cuda_build.__name__):
            assert not few_row_gemm.takes_few_row(x, weight)
            assert not few_row_gemm.fits_few_row(x, weight)
            got = TritonOps().linear(x, weight)
        torch.testing.assert_close(got, want, atol=TOL, rtol=TOL)
        lines = [r.getMessage() for r in caplog.records]
        assert len(lines) == 1 and "no CUDA compiler (nvcc) found" in lines[0], lines
    finally:
        cuda_build.cuda_module.cache_clear()


@pytest.mark.parametrize("quantization", [None, "fp8"])
def test_the_built_in_model_answers_on_the_few_row_kernels(quantization, monkeypatch):
    """The built-in model (hidden 192) with CUDA graphs and programmatic dependent launch,
    every linear layer of a decode pass on the CUDA kernels (products, SiLU-mul and the
    add-norms epilogue): it still does its sums."""
    from vllm_rlt import LLM, SamplingParams
    from vllm_rlt.ops import triton_ops

    taken = set()

    def counted(name: str):
        kernel = getattr(triton_ops, name)

        def call(*args, **kwargs):
            taken.add(name)
            return kernel(*args, **kwargs)

        return call

    for name in ("few_row_gemm", "few_row_gemm_add_norms"):
        monkeypatch.setattr(triton_ops, name, counted(name))
    monkeypatch.setattr(few_row_gemm, "FP8_CUDA_ROWS", 16)
    monkeypatch.setattr(few_row_gemm, "BF16_CUDA_ROWS", 16)
    llm = LLM(device="cuda", quantization=quantization)
    problems = {"347+589=": "936", "123+456=": "579", "812-345=": "467", "4821*7=": "33747"}
    problems |= {"sort 52817=": "12578", "rev abcdefg=": "gfedcba"}
    params = SamplingParams(max_tokens=8, temperature=0.0)
    outputs = llm.generate(list(problems), params, use_tqdm=False)
    assert [o.outputs[0].text for o in outputs] == list(problems.values())
    assert taken == {"few_row_gemm", "few_row_gemm_add_norms"}
    assert llm.engine.runner.num_decode_graph_passes > 0
    del llm
