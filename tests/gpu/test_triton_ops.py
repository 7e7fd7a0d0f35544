"""Triton ops against the torch reference ops on random inputs."""

from __future__ import annotations

import pytest
import torch

from vllm_rlt.layers.rotary import RotaryEmbedding
from vllm_rlt.ops.metadata import AttentionMetadata
from vllm_rlt.ops.torch_ops import TorchOps
from vllm_rlt.worker.pass_inputs import KVGeometry, build_metadata, gather_rows

pytestmark = pytest.mark.gpu

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


@pytest.fixture(scope="module")
def triton_ops():
    from vllm_rlt.ops.triton_ops import TritonOps

    return TritonOps()


@pytest.fixture(autouse=True)
def triton_row_kernel(monkeypatch):
    """The Triton decode row kernel, not the CUDA one (test_paged_attention_cuda.py runs
    these checks through that)."""
    from vllm_rlt.kernels import paged_attention_cuda

    monkeypatch.setattr(paged_attention_cuda, "PADDED_HEADS", False)
    monkeypatch.setattr(paged_attention_cuda, "ANY_CACHE_ROWS", 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hidden", [2048, 3072, 5280])  # 4, 8 and 16 warps a row
def test_norms_and_activation(triton_ops, dtype, hidden):
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(37, hidden, device="cuda", generator=gen).to(dtype)
    y = torch.randn(37, hidden, device="cuda", generator=gen).to(dtype) * 3
    w1 = (1 + 0.1 * torch.randn(hidden, device="cuda", generator=gen)).to(dtype)
    w2 = (1 + 0.1 * torch.randn(hidden, device="cuda", generator=gen)).to(dtype)
    ref = TorchOps()
    tol = TOL[dtype]
    torch.testing.assert_close(
        triton_ops.rms_norm(x, w1, 1e-6), ref.rms_norm(x, w1, 1e-6), atol=tol, rtol=tol
    )
    for got, want in zip(
        triton_ops.add_rms_norm2(x, y, w1, w2, 1e-6),
        ref.add_rms_norm2(x, y, w1, w2, 1e-6),
        strict=True,
    ):
        torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    gu = torch.randn(37, 2 * 5632, device="cuda", generator=gen).to(dtype)
    torch.testing.assert_close(triton_ops.silu_mul(gu), ref.silu_mul(gu), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 7, 16, 17, 40, 64])
@pytest.mark.parametrize(
    "n,k", [(2048, 2048), (6144, 2048), (11264, 2048), (49152, 2048), (1000, 100), (2048, 5632)]
)
def test_linear_layers(triton_ops, dtype, rows, n, k):
    """Skinny kernel (few rows) and cuBLAS (many) against the torch ops, with the SiLU-mul
    epilogue (interleaved gate/up rows) and the live-row mask of the LM head."""
    gen = torch.Generator(device="cuda").manual_seed(rows)
    x = torch.randn(rows, k, device="cuda", generator=gen).to(dtype)
    w = (torch.randn(n, k, device="cuda", generator=gen) / k**0.5).to(dtype)
    ref = TorchOps()
    tol = TOL[dtype]
    torch.testing.assert_close(triton_ops.linear(x, w), ref.linear(x, w), atol=tol, rtol=tol)
    torch.testing.assert_close(
        triton_ops.linear_silu_mul(x, w), ref.linear_silu_mul(x, w), atol=tol, rtol=tol
    )
    idle = torch.zeros(rows, dtype=torch.bool, device="cuda")
    live = idle.clone()
    live[-1] = True
    got = triton_ops.linear(x, w, live)
    torch.testing.assert_close(got[-1], ref.linear(x, w)[-1], atol=tol, rtol=tol)
    from vllm_rlt.ops.linear_plans import linear_plan  # needs triton: import here

    if linear_plan(x, w, live=True) is not None:  # one row tile: nothing live, no weight
        assert not triton_ops.linear(x, w, idle).any()  # read, zeros (LIVE_SKINNY_ROWS)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 4, 8])
@pytest.mark.parametrize("fp8", [False, True], ids=["weight", "fp8_weight"])
@pytest.mark.parametrize("n,k", [(2048, 2048), (11264, 2048), (1000, 256)])
def test_strip_gemv(dtype, rows, fp8, n, k):
    """Weight strips held in registers (kernels/strip_gemv.py), at every row count a
    STRIP_GEMV_ROWS setting may send them, with a strip cut short at N, against torch."""
    from vllm_rlt.kernels.strip_gemv import strip_gemv
    from vllm_rlt.layers.fp8 import Fp8Weight

    gen = torch.Generator(device="cuda").manual_seed(rows + n)
    x = torch.randn(rows, k, device="cuda", generator=gen).to(dtype)
    w = (torch.randn(n, k, device="cuda", generator=gen) / k**0.5).to(dtype)
    weight = Fp8Weight.quantize(w) if fp8 else w
    dense = weight.dequantize(torch.float32) if fp8 else w.float()
    want = x.float() @ dense.T
    tol = TOL[dtype]
    product = strip_gemv(x, weight)
    torch.testing.assert_close(product, want.to(dtype), atol=tol, rtol=tol)
    # The epilogue against the torch ops on the kernel's own product: a product a rounding
    # step off in both gate and up would compound past the tolerance.
    silu = TorchOps().silu_mul(product)
    torch.testing.assert_close(strip_gemv(x, weight, silu_mul=True), silu, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 7, 16, 17, 40, 64, 65])
@pytest.mark.parametrize("n,k", [(2048, 2048), (2048, 5632), (1000, 100), (96, 700)])
@pytest.mark.parametrize("branch_norm", [True, False])
def test_linear_add_rms_norm2(triton_ops, dtype, rows, n, k, branch_norm):
    """The projection fused with the residual add and norm (split-K slices summed by the
    norm kernel where the plan splits) against the torch ops."""
    gen = torch.Generator(device="cuda").manual_seed(rows + n)
    x = torch.randn(rows, k, device="cuda", generator=gen).to(dtype)
    w = (torch.randn(n, k, device="cuda", generator=gen) / k**0.5).to(dtype)
    h = torch.randn(rows, n, device="cuda", generator=gen).to(dtype)
    w1 = (1 + 0.1 * torch.randn(n, device="cuda", generator=gen)).to(dtype)
    w2 = (1 + 0.1 * torch.randn(n, device="cuda", generator=gen)).to(dtype)
    w_branch = w1 if branch_norm else None
    tol = TOL[dtype]
    got = triton_ops.linear_add_rms_norm2(h, x, w, w_branch, w2, 1e-6)
    want = TorchOps().linear_add_rms_norm2(h, x, w, w_branch, w2, 1e-6)
    for g, expected in zip(got, want, strict=True):
        torch.testing.assert_close(g, expected, atol=tol, rtol=tol)


class _State:
    """The slot-state fields the metadata builders read."""

    def __init__(self, block_table, loop, position):
        self.block_table, self.loop, self.position = block_table, loop, position
        self.exit_wait = None  # no row is held back for an exit sync


# The masked lanes of a head size that is no power of two are the same code in every
# dtype and head count: one combination per launch shape and layout keeps the suite short.
HEAD_96_COVERED = "head size 96 runs each launch shape and layout in one dtype"


@pytest.mark.parametrize("dim", [128, 96])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("planes", "table_planes"), [(4, 1), (1, 1), (1, 4)], ids=["last_exited", "shared", "sd"]
)
@pytest.mark.parametrize("kv_heads", [16, 4])
@pytest.mark.parametrize("with_prompts", [True, False], ids=["mixed", "decode_only"])
@pytest.mark.parametrize(
    "launch",
    [
        "plain",
        "bounded_grid",
        "many_rows",
        "two_kernels",
        "split_kv",
        "one_split",
        "grouped",
        "ungrouped",
    ],
)
def test_rope_write_and_paged_attention(
    triton_ops, monkeypatch, dim, dtype, planes, table_planes, kv_heads, with_prompts, launch
):
    """Decode rows at mixed loops, with or without prefill chunks: same cache contents, same
    outputs. With a table row per loop (SHARED_DECODE), a prompt chunk at loop 0 goes
    through its slot's first row, one at the last loop and every decode row through the
    last. Each launch shape of the row kernel: as an eager pass runs it, as a captured
    prompt pass runs it (counts read on the device, fewer programs than rows and tiles, so
    each takes several), and with the key tile and the RoPE kernel of passes of many rows.
    A decode-only pass writes and attends in one kernel; "two_kernels" runs it as a pass
    with speculation lanes does, the RoPE write first; "split_kv" splits each row's
    16-key tiles into 4 runs (some empty) combined by a second kernel, in the fused kernel
    (decode only) and in the row kernel (beside prompt chunks); "one_split" never splits
    (few rows split by default). At 4 KV heads both kernels
    run a program per KV head for its group of query heads (GROUPED_DECODE_HEADS):
    "grouped" takes the row kernel even for decode alone, with split-KV runs; "ungrouped"
    runs a program per query head instead. Head size 96 (Huginn-0125's) lies on 128 lanes,
    the last 32 masked: every launch shape and layout in bf16 with 4 KV heads."""
    if dim == 96 and (dtype != torch.bfloat16 or kv_heads != 4):
        pytest.skip(HEAD_96_COVERED)
    shape = (dtype, planes, table_planes, kv_heads, with_prompts, launch)
    _check_attention(triton_ops, monkeypatch, *shape, dim=dim)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("launch", ["plain", "bounded_grid", "many_rows", "two_kernels"])
@pytest.mark.parametrize("with_prompts", [True, False], ids=["mixed", "decode_only"])
def test_one_plane_layers_of_a_looped_pass(triton_ops, monkeypatch, dtype, launch, with_prompts):
    """The metadata of a pass at mixed loops turned to one plane (`single_plane`, for
    layers that run once per token): every row reads and writes plane 0, in each launch
    shape, as the torch ops do."""
    _check_attention(triton_ops, monkeypatch, dtype, 4, 1, 4, with_prompts, launch, one_plane=True)


@pytest.mark.parametrize("dim", [128, 96])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("planes", "table_planes"), [(4, 1), (1, 4)], ids=["last_exited", "sd"])
@pytest.mark.parametrize(
    "launch",
    ["plain", "bounded_grid", "many_rows", "split_kv", "one_split", "grouped", "ungrouped"],
)
@pytest.mark.parametrize("scaled", [False, True], ids=["unscaled", "scaled"])
@pytest.mark.parametrize("with_prompts", [True, False], ids=["mixed", "decode_only"])
def test_rope_write_and_paged_attention_over_an_fp8_cache(
    triton_ops, monkeypatch, dim, dtype, planes, table_planes, launch, scaled, with_prompts
):
    """The same with float8 K/V (--kv-cache-dtype fp8): the kernels round what they write
    as torch does and widen what they read. A key the two paths rotate one bf16 ulp apart
    may round to neighbouring float8 values (1/8 apart at most), so keys match to a float8
    step and outputs closely. Scaled: per-head K and V scales (an FP8 checkpoint's
    k_scale, v_scale) divide what is written and multiply what is read. Head size 96:
    bf16, scaled."""
    if dim == 96 and (dtype != torch.bfloat16 or not scaled):
        pytest.skip(HEAD_96_COVERED)
    _check_attention(
        triton_ops,
        monkeypatch,
        dtype,
        planes,
        table_planes,
        4,
        with_prompts,
        launch,
        torch.float8_e4m3fn,
        scaled,
        dim=dim,
    )


def _check_attention(
    triton_ops,
    monkeypatch,
    dtype,
    planes,
    table_planes,
    kv_heads,
    with_prompts,
    launch,
    kv_dtype=None,
    scaled=False,
    one_plane=False,
    dim=128,
):
    from vllm_rlt.core.contract import PrefillChunk
    from vllm_rlt.ops import triton_ops as triton_module
    from vllm_rlt.ops.metadata import DeviceCounts

    gen = torch.Generator(device="cuda").manual_seed(1)
    heads, bs, slots = 16, 16, 8
    table_rows = (slots + 2) * table_planes
    num_blocks = 8 * table_rows
    geo = KVGeometry(
        planes=planes,
        block_size=bs,
        num_blocks=num_blocks,
        write_deeper_planes=planes > 1,
        table_planes=table_planes,
    )
    table = torch.full((table_rows, 16), num_blocks, dtype=torch.int64, device="cuda")
    perm = torch.randperm(num_blocks, generator=gen, device="cuda")
    for row in range(table_rows):
        table[row, :8] = perm[row * 8 : (row + 1) * 8]
    loops = max(planes, table_planes)
    loop = torch.tensor([0, 1, 2, 3, 3, 0, 2, 1, 0], device="cuda") % planes
    position = torch.tensor([5, 17, 40, 63, 1, 100, 33, 0, 0], device="cuda")
    state = _State(table, loop, position)
    decode = torch.arange(6, device="cuda")
    chunks = (
        PrefillChunk(7, "a", start=20, token_ids=tuple(range(45)), loop=loops - 1, samples=False),
        PrefillChunk(8, "b", start=0, token_ids=tuple(range(5)), loop=0, samples=False),
    )
    if not with_prompts:
        chunks = ()
    rows = gather_rows(decode, chunks, state, geo)
    meta: AttentionMetadata = build_metadata(rows, chunks, state, geo, 128, with_segments=True)
    tiled = build_metadata(
        rows,
        chunks,
        state,
        geo,
        128,
        with_segments=False,
        tile_rows=triton_ops.prefill_tile_rows(dtype),
    )
    assert (tiled.prefill_tiles is not None and tiled.num_decode == 6) == with_prompts
    if launch == "bounded_grid":
        num_tiles = tiled.prefill_tiles.num_tiles if with_prompts else 0
        assert num_tiles > 2 or not with_prompts
        counts = torch.tensor([6, num_tiles], device="cuda")
        tiled.device_counts = DeviceCounts(counts, row_programs=4, tile_programs=2)
    elif launch == "many_rows":
        monkeypatch.setattr(triton_module, "MANY_ROWS", 1)
        monkeypatch.setattr(triton_module, "ROPE_BY_ROW", 1)
    elif launch == "two_kernels":
        tiled.rows_independent = False
    elif launch == "split_kv":  # 6 rows x 16 heads x 4 runs; up to 7 tiles a row (fused
        # kernel for decode alone, the row kernel beside prompt tiles)
        monkeypatch.setattr(triton_module, "SPLIT_KV_PROGRAMS", 6 * 16 * 4)
        monkeypatch.setattr(triton_module, "DECODE_BLOCK_N", 16)
        assert triton_module.decode_splits(6, 16) == 4
    elif launch == "one_split":
        monkeypatch.setattr(triton_module, "SPLIT_KV_PROGRAMS", 0)
    elif launch == "grouped":  # the row kernel even for decode alone; 4 runs at 4 KV heads
        monkeypatch.setattr(triton_module, "GROUPED_DECODE_HEADS", 2)
        monkeypatch.setattr(triton_module, "SPLIT_KV_PROGRAMS", 6 * 4 * 4)
        monkeypatch.setattr(triton_module, "DECODE_BLOCK_N", 16)
        tiled.rows_independent = False
    elif launch == "ungrouped":
        monkeypatch.setattr(triton_module, "GROUPED_DECODE_HEADS", 0)
    assert tiled.rows_independent == (not with_prompts and launch not in ("two_kernels", "grouped"))
    if one_plane:  # a layer outside the loop (Huginn's prelude and coda) in the same pass
        meta, tiled, planes = meta.single_plane(), tiled.single_plane(), 1
    qkv = torch.randn(
        rows.positions.shape[0], (heads + 2 * kv_heads) * dim, device="cuda", generator=gen
    ).to(dtype)
    rotary = RotaryEmbedding(dim, 1e6, 4096, dtype, "cuda")
    cache_shape = (planes * geo.slots_per_plane, kv_heads, dim)
    k_init = torch.randn(cache_shape, device="cuda", generator=gen).to(kv_dtype or dtype)
    v_init = torch.randn(cache_shape, device="cuda", generator=gen).to(kv_dtype or dtype)
    k_ref, v_ref, k_tri, v_tri = k_init.clone(), v_init.clone(), k_init.clone(), v_init.clone()
    # scales far from 1 both ways, so that a scale applied twice, or not at all, shows
    scales = None
    if scaled:
        scales = tuple(0.05 + 4 * torch.rand(kv_heads, device="cuda", generator=gen) for _ in "kv")
    args = (heads, kv_heads)
    want = TorchOps().attention(qkv, *args, k_ref, v_ref, meta, rotary, dim**-0.5, scales)
    got = triton_ops.attention(qkv, *args, k_tri, v_tri, tiled, rotary, dim**-0.5, scales)
    dummy = slice(geo.dummy_index, geo.dummy_index + bs)
    for plane in range(planes):  # the torch path also scribbles on the dummy block
        base = plane * geo.slots_per_plane
        for cache in (k_ref, v_ref, k_tri, v_tri):
            cache.view(torch.uint8)[base + dummy.start : base + dummy.stop] = 0
    tol = TOL[dtype] if kv_dtype is None else 0.07
    # e4m3 has 3 mantissa bits: neighbouring values are up to 1/8 apart
    key_tol = tol if kv_dtype is None else 0.13
    torch.testing.assert_close(k_tri.float(), k_ref.float(), atol=key_tol, rtol=key_tol)
    torch.testing.assert_close(v_tri.float(), v_ref.float(), atol=0, rtol=0)
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)


@pytest.mark.parametrize("rows", [1, 3, 17, 256])
@pytest.mark.parametrize("vocab", [300, 2048, 49152, 65537])
@pytest.mark.parametrize("greedy", [True, False])
def test_token_stats_equal_torch(rows, vocab, greedy):
    """The one-read logprob and rank against the torch form, with ties at the top, a
    masked prefix and a token at either end of the vocabulary."""
    from vllm_rlt.ops.triton_ops import TritonOps

    gen = torch.Generator(device="cuda").manual_seed(rows * vocab)
    logits = 6 * torch.randn(rows, vocab, device="cuda", generator=gen)
    logits[0, :5] = float("-inf")
    if rows > 2:
        logits[2, [7, vocab - 1]] = logits[2].max() + 1  # a tie: the first is the argmax
    tokens = None
    if not greedy:
        tokens = torch.randint(5, vocab, (rows,), device="cuda", generator=gen)
        tokens[-1] = vocab - 1
    want = TorchOps().token_stats(logits, tokens)
    got = TritonOps().token_stats(logits, tokens)
    assert torch.equal(got[0], want[0])
    torch.testing.assert_close(got[1], want[1], atol=1e-5, rtol=1e-5)
    # The rank counts logits at least the token's. The torch form compares logprobs, where
    # two logits a few ulps apart can round to one value (12M normal draws at 256 rows of
    # 49,152 make that likely), so the kernel is held to the exact count on the logits.
    chosen = logits.gather(1, got[0].unsqueeze(1))
    assert torch.equal(got[2], (logits >= chosen).sum(1))


@pytest.mark.parametrize("rows", [1, 3, 64, 256])
@pytest.mark.parametrize("vocab", [300, 49152, 65537])
def test_plain_sampling_kernel_draws_the_sort_paths_token(rows, vocab):
    """kernels/gumbel_sample.py against the torch form and the sorted path: the same
    token at every seed and counter, with barred tokens, ties (within a run and across
    runs of the vocabulary), greedy rows and a tiny temperature."""
    from vllm_rlt.layers.sampler import SamplingTensors, sample, sample_plain
    from vllm_rlt.ops.triton_ops import TritonOps

    gen = torch.Generator(device="cuda").manual_seed(rows + vocab)
    logits = 4 * torch.randn(rows, vocab, device="cuda", generator=gen)
    logits[0, : vocab // 2] = float("-inf")
    logits[-1, [3, vocab - 1]] = logits[-1].max() + 1
    temperature = 2 * torch.rand(rows, device="cuda", generator=gen)
    temperature[rows // 2] = 0.0
    temperature[-1] = 1e-9
    seeds = torch.randint(0, 2**62, (rows,), device="cuda", generator=gen)
    seeds[0] = 2**63 - 1
    counters = torch.randint(0, 2**40, (rows,), device="cuda", generator=gen)
    got = TritonOps().sample_plain(logits, temperature, seeds, counters)
    assert torch.equal(got, sample_plain(logits, temperature, seeds, counters))
    settings = SamplingTensors.filled(rows, "cuda", temperature=temperature, seed=seeds)
    assert torch.equal(got, sample(logits, settings, counters))


@pytest.mark.parametrize("rows", [1, 3, 64, 256])
@pytest.mark.parametrize("vocab", [300, 49152, 65537])
def test_filtered_sampling_without_a_sort_draws_the_sort_orders_token(rows, vocab):
    """Rows that filter (top-k, top-p, min-p, top-n-sigma) beside rows that do not: the cut
    found by kernels/filter_bound.py and the draw of kernels/gumbel_sample.py give the
    token a sort-based sampler draws."""
    from tests.e2e.test_sampling import drawn_in_sorted_order, hard_sampling_case
    from vllm_rlt.ops.triton_ops import TritonOps

    gen = torch.Generator(device="cuda").manual_seed(rows * vocab)
    logits, settings, counters = hard_sampling_case(rows, vocab, gen, "cuda")
    got = TritonOps().sample_filtered(logits, settings, counters)
    assert torch.equal(got, drawn_in_sorted_order(logits, settings, counters))


def _kept_by_sorting(scaled, settings):
    """[rows, vocab] bool: the finite tokens the sorted filters keep, and [rows, vocab]
    float64: the mass above each token in the sorted order, over the top-k's mass."""
    from vllm_rlt.layers.sampler import SamplingTensors, _filtered_sorted

    unscaled = SamplingTensors(
        **{**settings.columns(), "temperature": settings.temperature * 0 + 1}
    )
    sorted_logits, sorted_ids = _filtered_sorted(scaled, unscaled)
    kept = torch.zeros_like(scaled, dtype=torch.bool).scatter_(
        1, sorted_ids, sorted_logits.isfinite()
    )
    ranked = scaled.gather(1, sorted_ids).double()
    k = torch.where(settings.top_k > 0, settings.top_k, scaled.shape[1]).unsqueeze(1)
    rank = torch.arange(scaled.shape[1], device=scaled.device).unsqueeze(0)
    probs = ranked.masked_fill(rank >= k, float("-inf")).softmax(dim=-1)
    before = torch.zeros_like(probs).scatter_(1, sorted_ids, probs.cumsum(-1) - probs)
    return kept & scaled.isfinite(), before


@pytest.mark.parametrize("rows", [1, 3, 64, 256])
@pytest.mark.parametrize("vocab", [300, 4097, 49152, 65537])
def test_the_searched_cut_keeps_what_the_sorted_filters_keep(rows, vocab):
    """kernels/filter_bound.py against the sorted filters, token by token: float logits,
    runs of equal logits cut inside by top-k and top-p (ties kept by token id), -0.0
    beside 0.0, rows barred but for one token, top_k at and past the vocabulary, min_p 1,
    tiny top_p. A token may differ only within float32 rounding of a threshold: where its
    mass above is top_p's (the kernel sums in another order than the sort's running sum),
    or its probability over the top's is min_p's (the kernel compares exp(x - top))."""
    from vllm_rlt.kernels.filter_bound import filter_bound, kept_by
    from vllm_rlt.layers.sampler import SamplingTensors

    gen = torch.Generator(device="cuda").manual_seed(rows + vocab)
    scaled = 4 * torch.randn(rows, vocab, device="cuda", generator=gen)
    tied = torch.arange(rows, device="cuda") % 3 == 1
    whole = torch.randint(-2, 3, (rows, vocab), device="cuda", generator=gen).float()
    scaled = torch.where(tied.unsqueeze(1), whole, scaled)
    scaled[0, ::2], scaled[0, 1::4] = -0.0, 0.0
    if rows > 2:
        scaled[2, 1:] = float("-inf")
    pick = torch.arange(rows, device="cuda") % 6
    top_k = torch.randint(1, 2 * vocab, (rows,), device="cuda", generator=gen)
    top_p = torch.rand(rows, device="cuda", generator=gen)
    settings = SamplingTensors.filled(
        rows,
        "cuda",
        top_k=torch.where(pick % 2 == 1, top_k, 0),
        top_p=torch.where(pick >= 2, top_p.clamp_min(1e-9), 1.0),
        min_p=torch.where(pick == 5, torch.where(top_p < 0.2, 1.0, top_p * 0.1), 0.0),
    )
    got = kept_by(scaled, filter_bound(scaled, settings.top_k, settings.top_p, settings.min_p))
    want, before = _kept_by_sorting(scaled, settings)
    differ = (got & scaled.isfinite()) != want
    near = (before - settings.top_p.double().unsqueeze(1)).abs() < 1e-5
    ratio = (scaled.double() - scaled.double().amax(dim=-1, keepdim=True)).exp()
    min_p = settings.min_p.double().unsqueeze(1)
    near |= (ratio - min_p).abs() <= 1e-5 * min_p
    assert not (differ & ~near).any()
    assert differ.sum() <= rows // 8 + 1
    assert got.gather(1, scaled.argmax(dim=-1, keepdim=True)).all()


def test_a_min_p_above_one_still_keeps_the_top_token():
    """The API bounds min_p to [0, 1]; a caller of the kernel past it still gets the top
    token (with no tie at the top, the one the sort path keeps), not an empty row."""
    from vllm_rlt.kernels.filter_bound import filter_bound, kept_by

    scaled = torch.randn(3, 4097, device="cuda", generator=torch.Generator("cuda").manual_seed(5))
    none = torch.zeros(3, dtype=torch.long, device="cuda")
    min_p = torch.tensor([1.0, 1.5, 1e30], device="cuda")
    kept = kept_by(scaled, filter_bound(scaled, none, torch.ones(3, device="cuda"), min_p))
    assert kept.sum(dim=1).tolist() == [1, 1, 1]
    assert kept.gather(1, scaled.argmax(dim=-1, keepdim=True)).all()


@pytest.mark.parametrize("rows", [1, 3, 256])
@pytest.mark.parametrize("vocab", [300, 49152, 65537])
def test_top_n_sigma_in_place_equals_torch(rows, vocab):
    """The in-place kernel against the torch filter: rows that filter at several n, rows
    that do not (n 0 or below: untouched), tokens already barred (-inf, not counted)."""
    from vllm_rlt.kernels.top_n_sigma import top_n_sigma_
    from vllm_rlt.layers.sampler import top_n_sigma

    gen = torch.Generator(device="cuda").manual_seed(rows + vocab)
    scaled = 3 * torch.randn(rows, vocab, device="cuda", generator=gen)
    scaled[0, :17] = float("-inf")
    n = torch.tensor([1.0, 0.0, 2.5, -1.0], device="cuda").repeat(rows)[:rows]
    want = top_n_sigma(scaled.clone(), n)
    got = top_n_sigma_(scaled.clone(), n)
    assert torch.equal(got.isinf(), want.isinf())
    assert torch.equal(got[got.isfinite()], want[want.isfinite()])
