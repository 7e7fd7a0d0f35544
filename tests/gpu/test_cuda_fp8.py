"""FP8 on CUDA: the skinny kernels (float8 tiles widened in registers, scaled accumulators)
and the FP8 tensor-core path against the torch reference, the engine with fp8 weights
against the CPU engine with the same weights, and the built-in model under fp8 weights and
K/V (the attention kernels over an fp8 cache are checked in test_triton_ops.py)."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from tests.conftest import drain
from tests.e2e.test_engine_vs_oracle import MAX_TOKENS, _prompts
from vllm_rlt import LLM, CacheConfig, ExecutionConfig, SamplingParams, SchedulerConfig
from vllm_rlt.engine.builder import build_engine_core
from vllm_rlt.engine_config import DeviceConfig, EngineConfig
from vllm_rlt.layers.fp8 import FP8_DTYPE, FP8_MAX, Fp8Weight
from vllm_rlt.models.ouro import OuroConfig, OuroModel
from vllm_rlt.ops.torch_ops import TorchOps
from vllm_rlt.tokenizer import Tokenizer

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("exact_float32")]

TOL = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 2e-2}


@pytest.fixture(scope="module")
def triton_ops():
    from vllm_rlt.ops.triton_ops import TritonOps

    return TritonOps()


def _expected(x: torch.Tensor, q: Fp8Weight, skinny: bool) -> torch.Tensor:
    """The reference product; the tensor-core path (many bf16 rows) also rounds each row
    of x to float8 with its own scale, so the reference does the same there."""
    if not skinny and x.dtype == torch.bfloat16:
        scale = x.float().abs().amax(dim=1, keepdim=True) / FP8_MAX
        x = ((x.float() / scale).to(FP8_DTYPE).float() * scale).to(x.dtype)
    return TorchOps().linear(x.float(), Fp8Weight(q.data, q.scale)).to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 16, 17, 40, 64, 65, 300])
@pytest.mark.parametrize("n,k", [(2048, 2048), (6144, 2048), (11264, 2048), (2048, 5632)])
def test_fp8_linear_ops_equal_the_reference(triton_ops, dtype, rows, n, k):
    from vllm_rlt.ops.linear_plans import linear_plan

    gen = torch.Generator(device="cuda").manual_seed(rows + n)
    x = torch.randn(rows, k, device="cuda", generator=gen).to(dtype)
    q = Fp8Weight.quantize(torch.randn(n, k, device="cuda", generator=gen) / k**0.5)
    skinny = linear_plan(x, q) is not None
    tol = TOL[dtype] if skinny or dtype != torch.bfloat16 else 3e-2
    want = _expected(x, q, skinny)
    torch.testing.assert_close(triton_ops.linear(x, q), want, atol=tol, rtol=tol)
    silu = TorchOps().silu_mul(want.float()).to(dtype)
    torch.testing.assert_close(triton_ops.linear_silu_mul(x, q), silu, atol=tol, rtol=tol)
    if not skinny and dtype == torch.bfloat16:  # float8 rows, as a norm hands them on
        from vllm_rlt.kernels.fp8_rows import quantize_rows

        got = triton_ops.linear_silu_mul(quantize_rows(x), q)
        torch.testing.assert_close(got, silu, atol=tol, rtol=tol)
    if n == 2048:  # o and down: the split-K partials summed by the norm kernel
        res = torch.randn(rows, n, device="cuda", generator=gen).to(dtype)
        w1 = torch.ones(n, device="cuda", dtype=dtype)
        got = triton_ops.linear_add_rms_norm2(res, x, q, w1, w1, 1e-6)
        ref = TorchOps().add_rms_norm2(res.float(), want.float(), w1.float(), w1.float(), 1e-6)
        for a, b in zip(got, ref, strict=True):
            torch.testing.assert_close(a, b.to(dtype), atol=2 * tol, rtol=2 * tol)
    if skinny:  # no live row: the weight is not read, the product is zero
        idle = torch.zeros(rows, dtype=torch.bool, device="cuda")
        assert not triton_ops.linear(x, q, idle).any()


def _engine(toy_config, toy_state, device, backend, layout, graphs):
    model = OuroModel(OuroConfig.from_dict(toy_config), toy_state, torch.float32, device)
    model.quantize("fp8")
    return build_engine_core(
        model,
        Tokenizer.byte_level(),
        EngineConfig(
            cache_config=CacheConfig(layout=layout, num_blocks=128, block_size=4),
            scheduler_config=SchedulerConfig(
                prefill_chunk_size=4, max_num_seqs=4, max_num_batched_tokens=64
            ),
            execution_config=ExecutionConfig(cuda_graphs=graphs, async_scheduling=graphs),
            device_config=DeviceConfig(attention_backend=backend),
        ),
    )


def _run(engine):
    arrivals = {
        step: [
            (
                f"r{i}",
                prompt,
                SamplingParams(max_tokens=MAX_TOKENS[i], temperature=0.0, exit_threshold=0.7),
            )
        ]
        for i, (step, prompt) in enumerate(zip((0, 1, 3, 17), _prompts(), strict=True))
    }
    outputs = drain(engine, arrivals)
    assert engine.all_blocks_free()
    return {rid: (o.outputs[0].token_ids, o.outputs[0].exit_depths) for rid, o in outputs.items()}


@pytest.mark.parametrize("layout", ["last_exited", "shared_decode"])
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_cuda_fp8_engine_equals_the_cpu_engine(toy_config, toy_state, layout, graphs):
    """float32 activations with fp8 weights: the Triton kernels give the CPU engine's
    tokens and exit depths, in graphs and out."""
    cpu = _run(_engine(toy_config, toy_state, "cpu", "torch", layout, False))
    cuda = _run(_engine(toy_config, toy_state, "cuda", "triton", layout, graphs))
    assert cuda == cpu


@pytest.mark.parametrize(
    ("quantization", "kv_cache_dtype"), [("fp8", "auto"), (None, "fp8"), ("fp8", "fp8")]
)
def test_cuda_fp8_built_in_model_answers(quantization, kv_cache_dtype):
    """bf16 activations, fp8 weights or K/V or both, graphs: the built-in model still does
    its sums."""
    llm = LLM(device="cuda", quantization=quantization, kv_cache_dtype=kv_cache_dtype)
    params = SamplingParams(max_tokens=8, temperature=0.0)
    outputs = llm.generate(["347+589=", "123+456=", "812-345="], params, use_tqdm=False)
    assert [o.outputs[0].text for o in outputs] == ["936", "579", "467"]
    del llm


def test_cuda_fp8_checkpoint_with_kv_scales_answers(tmp_path):
    """An FP8 checkpoint with K/V scales far from 1, on a float8 cache, graphs: the
    kernels divide and multiply by them consistently, so the sums still come out."""
    from tests.unit.test_fp8_kv_scales import fp8_copy_of_the_built_in_model

    fp8_copy_of_the_built_in_model(tmp_path, 0.25, 4.0)
    llm = LLM(model=str(tmp_path), device="cuda", kv_cache_dtype="fp8")
    params = SamplingParams(max_tokens=8, temperature=0.0)
    outputs = llm.generate(["347+589=", "123+456=", "812-345="], params, use_tqdm=False)
    assert [o.outputs[0].text for o in outputs] == ["936", "579", "467"]
    del llm


def _tile_label(tile) -> str:
    if tile is None:
        return "cublas"
    from vllm_rlt.ops.w8a8_tables import tile_label

    return tile_label(tile)


def _fp8_tiles():
    """cuBLAS (None), every tile of the built-in table and of each GPU model's table (the
    package's and the user's), and uneven splits of K, summed outside and in the kernel."""
    from vllm_rlt.kernels.w8a8_tile import W8A8Tile
    from vllm_rlt.ops.w8a8_tables import W8A8_PLANS, table_dirs, table_from_json

    files = [path for folder in table_dirs() for path in folder.glob("*.json")]
    tables = [W8A8_PLANS, *(table_from_json(json.loads(p.read_text())) for p in files)]
    tiles = {tile for t in tables for plans in t.values() for _, tile in plans if tile}
    extra = [W8A8Tile(64, 64, 128, split_k=3), W8A8Tile(64, 64, 128, split_k=3, reduce=True)]
    extra.append(W8A8Tile(64, 32, 128, split_k=2, promote=True, reduce=True))
    return [None, *sorted(tiles, key=_tile_label), *extra]


def _fp8_product(x, q, tile) -> torch.Tensor:
    """x (Fp8Rows) @ q.T in float32 by cuBLAS or a W8A8 tile, split-K partials summed."""
    from vllm_rlt.kernels.fp8_rows import fp8_rows_linear
    from vllm_rlt.kernels.w8a8_gemm import w8a8_gemm

    if tile is None:
        return fp8_rows_linear(x, q).float()
    got = w8a8_gemm(x, q, tile).float()
    return got.sum(0) if got.dim() == 3 else got


@pytest.mark.parametrize("tile", _fp8_tiles(), ids=_tile_label)
def test_tensor_core_path_scales_rows_and_columns(tile):
    """A direct check of the many-row products: rows of very different size keep their
    relative precision (each row has its own activation scale)."""
    from vllm_rlt.kernels.fp8_rows import quantize_rows

    gen = torch.Generator(device="cuda").manual_seed(3)
    x = torch.randn(128, 256, device="cuda", generator=gen)
    x = (x * torch.logspace(-4, 4, 128, device="cuda")[:, None]).to(torch.bfloat16)
    q = Fp8Weight.quantize(torch.randn(512, 256, device="cuda", generator=gen))
    got = _fp8_product(quantize_rows(x), q, tile)
    want = F.linear(x.float(), q.dequantize(torch.float32))
    relative = (got - want).norm(dim=1) / want.norm(dim=1)
    assert relative.max() < 0.08


@pytest.mark.parametrize("tile", _fp8_tiles(), ids=_tile_label)
@pytest.mark.parametrize("rows", [1, 3, 16, 17, 64, 255, 512])
@pytest.mark.parametrize("n,k", [(2048, 5632), (100, 200)])
def test_w8a8_tiles_equal_the_float32_product_of_their_inputs(tile, rows, n, k):
    """Every tile the plans use, at edge row counts and at shapes no tile divides: the
    product of exactly the float8 values and scales it reads (split-K partials summed), up
    to the output's rounding."""
    from vllm_rlt.kernels.fp8_rows import quantize_rows

    if tile is None and (n % 16 or k % 16):
        pytest.skip("cuBLAS's FP8 product takes only multiples of 16 (nor does the engine ask)")
    gen = torch.Generator(device="cuda").manual_seed(rows + n)
    x = quantize_rows(torch.randn(rows, k, device="cuda", generator=gen).to(torch.bfloat16))
    q = Fp8Weight.quantize(torch.randn(n, k, device="cuda", generator=gen) / k**0.5)
    want = (x.data.float() * x.scale) @ q.dequantize(torch.float32).T
    got = _fp8_product(x, q, tile)
    # bf16 out, or float32 partial sums; on sm_90 Triton accumulates a slice's whole chain
    # of FP8 tensor-core products in the tensor cores' reduced precision (its default
    # max_num_imprecise_acc there is 2^30), so the error grows with K / split: 1.2e-3 at
    # most at K = 200, past 3e-3 at K = 5,632 (H200), and at 512 rows by a 2,816-long chain
    # past 1e-2 in one case of 98 (H100)
    tol = 2e-2
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)


@pytest.mark.parametrize("rows", [17, 255, 512])
@pytest.mark.parametrize("split_k", [2, 4])
def test_promoted_w8a8_tiles_sum_in_float32(rows, split_k):
    """With `promote` each K chunk's tensor-core product is added into a float32 sum. The
    float32 partials (split-K; a bf16 output would hide it under its own rounding) of a
    K = 5,632 product then lie within 3e-4 of the exact product, relative, and at most half
    as far as the same tile's without promotion: 1.3e-4 against 6.7e-4 on an H100 (split-K
    4)."""
    from vllm_rlt.kernels.fp8_rows import quantize_rows
    from vllm_rlt.kernels.w8a8_tile import W8A8Tile

    gen = torch.Generator(device="cuda").manual_seed(rows + split_k)
    x = quantize_rows(torch.randn(rows, 5632, device="cuda", generator=gen).to(torch.bfloat16))
    q = Fp8Weight.quantize(torch.randn(2048, 5632, device="cuda", generator=gen) / 75.0)
    want = (x.data.float() * x.scale) @ q.dequantize(torch.float32).T

    def error(promote: bool) -> float:
        tile = W8A8Tile(64, 64, 128, split_k=split_k, promote=promote)
        return ((_fp8_product(x, q, tile) - want).norm() / want.norm()).item()

    promoted, plain = error(True), error(False)
    assert promoted < 3e-4 and promoted < plain / 2, (promoted, plain)


@pytest.mark.parametrize("rows", [1, 17, 255])
@pytest.mark.parametrize("silu_mul", [False, True], ids=["product", "silu_mul"])
def test_reducing_tiles_sum_their_slices_the_same_way_every_launch(rows, silu_mul):
    """A tile that splits K and sums the slices itself (the last slice of each output tile
    to finish sums them, in slice order) gives the same bits at every launch, eager and in
    a replayed CUDA graph, and leaves its tile counters at zero; it equals the slices' own
    partial sums added in the same order, bit for bit."""
    from vllm_rlt.kernels import w8a8_gemm as kernel
    from vllm_rlt.kernels.fp8_rows import quantize_rows
    from vllm_rlt.kernels.w8a8_tile import W8A8Tile

    gen = torch.Generator(device="cuda").manual_seed(rows)
    x = quantize_rows(torch.randn(rows, 2048, device="cuda", generator=gen).to(torch.bfloat16))
    q = Fp8Weight.quantize(torch.randn(6144, 2048, device="cuda", generator=gen) / 45.0)
    tile = W8A8Tile(64, 64, 128, split_k=4, reduce=True)
    first = kernel.w8a8_gemm(x, q, tile, silu_mul=silu_mul)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = kernel.w8a8_gemm(x, q, tile, silu_mul=silu_mul)
    for _ in range(3):
        graph.replay()
        assert torch.equal(captured, first)
    assert torch.equal(kernel.w8a8_gemm(x, q, tile, silu_mul=silu_mul), first)
    torch.cuda.synchronize()
    assert not kernel._COUNTERS[x.data.device].any()
    parts = kernel.w8a8_gemm(x, q, W8A8Tile(64, 64, 128, split_k=4))
    summed = (((parts[0] + parts[1]) + parts[2]) + parts[3]).to(torch.bfloat16)
    if silu_mul:  # the SiLU-mul epilogue rounds where the torch reference does
        want = TorchOps().silu_mul(summed)
        torch.testing.assert_close(first, want, atol=1e-2, rtol=1e-2)
    else:
        assert torch.equal(first, summed)


def test_w8a8_tiles_decode_the_built_in_model_as_cublas_does(monkeypatch):
    """The built-in model under fp8 weights decoding 48 and 200 rows at once, with CUDA
    graphs: the same greedy tokens with the W8A8 tiles as with cuBLAS's FP8 products."""
    from vllm_rlt.ops import linear_plans

    prompts = [f"{a}+{b}=" for a, b in zip(range(100, 300), range(300, 500), strict=True)]
    params = SamplingParams(max_tokens=6, temperature=0.0)

    def tokens() -> list[list[list[int]]]:
        llm = LLM(device="cuda", quantization="fp8", max_num_seqs=256)
        batches = [llm.generate(prompts[:count], params, use_tqdm=False) for count in (48, 200)]
        return [[o.outputs[0].token_ids for o in outputs] for outputs in batches]

    tiled = tokens()
    monkeypatch.setattr(linear_plans, "w8a8_table", lambda device: {})
    assert tokens() == tiled


@pytest.mark.parametrize("rows", [2, 16, 17, 64, 255])
@pytest.mark.parametrize("n,inter", [(2048, 5632), (192, 512)])
def test_norms_and_silu_mul_hand_on_what_the_quantize_kernel_gives(triton_ops, rows, n, inter):
    """Before an FP8 tensor-core product the norm and SiLU-mul kernels leave their output
    in float8 with its per-token scale: bit for bit what their bf16 output through the
    quantize kernel gives, so folding the quantize in changes no result."""
    from vllm_rlt.kernels.fp8_rows import Fp8Rows, quantize_rows

    gen = torch.Generator(device="cuda").manual_seed(rows + n)

    def randn(*shape):
        return torch.randn(*shape, device="cuda", generator=gen).to(torch.bfloat16)

    def fp8(rows_k: int, k: int) -> Fp8Weight:
        return Fp8Weight.quantize(torch.randn(rows_k, k, device="cuda", generator=gen) / k**0.5)

    def same(got, plain: torch.Tensor) -> None:
        want = quantize_rows(plain)
        assert isinstance(got, Fp8Rows)
        assert torch.equal(got.scale, want.scale)
        assert torch.equal(got.data.view(torch.uint8), want.data.view(torch.uint8))

    x, branch, w1, w2 = randn(rows, n), randn(rows, n), randn(n) + 1, randn(n) + 1
    x[rows - 1] = 0  # an all-zero row (a padding row) keeps a finite scale
    gate_up, down = fp8(2 * inter, n), fp8(n, inter)
    same(triton_ops.rms_norm(x, w2, 1e-6, gate_up), triton_ops.rms_norm(x, w2, 1e-6))
    for w_branch in (w1, None):
        x_out, normed = triton_ops.add_rms_norm2(x, branch, w_branch, w2, 1e-6, gate_up)
        plain = triton_ops.add_rms_norm2(x, branch, w_branch, w2, 1e-6)
        assert torch.equal(x_out, plain[0])
        same(normed, plain[1])
    product = randn(rows, 2 * inter)
    same(triton_ops.silu_mul(product, down), triton_ops.silu_mul(product))
    # the products take the float8 rows as they took the bf16 ones
    quantized = triton_ops.rms_norm(x, w2, 1e-6, gate_up)
    plain = triton_ops.rms_norm(x, w2, 1e-6)
    assert torch.equal(
        triton_ops.linear_silu_mul(quantized, gate_up, down).data,
        triton_ops.linear_silu_mul(plain, gate_up, down).data,
    )


def test_folded_quantize_leaves_many_row_fp8_decode_unchanged(monkeypatch):
    """The built-in model under fp8 weights decoding 48 rows at once, with CUDA graphs:
    the same tokens with the quantize folded into the norms as with a quantize kernel
    before each product."""
    from vllm_rlt.ops import triton_ops as module

    prompts = [f"{a}+{b}=" for a, b in zip(range(100, 148), range(300, 348), strict=True)]
    params = SamplingParams(max_tokens=6, temperature=0.0)

    def tokens() -> list[list[int]]:
        llm = LLM(device="cuda", quantization="fp8", max_num_seqs=64)
        outputs = llm.generate(prompts, params, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outputs]

    folded = tokens()
    monkeypatch.setattr(module, "takes_fp8_rows", lambda rows, dtype, weight: False)
    assert tokens() == folded
