"""The CUDA paged decode attention (kernels/paged_attention_cuda.py) against a float32 torch
reference at edge row counts, contexts and splits, bf16 and float8 caches with per-head
scales, head sizes 64 / 96 / 128 and grouped heads; and through the engine's attention op
in every launch shape and KV layout of the Triton row kernel's tests."""

from __future__ import annotations

import pytest
import torch

from tests.gpu.test_triton_ops import _check_attention
from vllm_rlt.kernels import cuda_build, paged_attention_cuda
from vllm_rlt.ops.metadata import AttentionMetadata

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
if cuda_build.find_nvcc() is None:
    pytest.skip("needs nvcc to build the CUDA kernels", allow_module_level=True)

BLOCK = 16


def _problem(rows, context, heads, kv_heads, dim, kv_dtype, planes, seed):
    """Random queries, a paged cache with blocks in random order, each row at a random
    plane and position below `context` (the first row at context - 1)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    per_row = -(-context // BLOCK)
    blocks = rows * per_row + 1
    slots = blocks * BLOCK
    q = torch.randn(rows, heads, dim, device="cuda", generator=gen).to(torch.bfloat16)
    cache = (planes * slots, kv_heads, dim)
    k = (torch.randn(cache, device="cuda", generator=gen) * 2).to(kv_dtype)
    v = torch.randn(cache, device="cuda", generator=gen).to(kv_dtype)
    order = torch.randperm(blocks, device="cuda", generator=gen)
    table = torch.full((rows + 3, per_row + 2), blocks - 1, dtype=torch.int64, device="cuda")
    table[3:, :per_row] = order[: rows * per_row].view(rows, per_row)
    positions = torch.randint(0, context, (rows,), device="cuda", generator=gen)
    positions[0] = context - 1
    meta = AttentionMetadata(
        positions=positions,
        row_tables=torch.arange(3, rows + 3, device="cuda"),  # rows 0-2 of the table unused
        read_plane=torch.randint(0, planes, (rows,), device="cuda", generator=gen),
        write_lo=positions,  # not read by decode attention
        write_hi=positions,
        row_entry=positions,
        block_table=table,
        planes=planes,
        slots_per_plane=slots,
        block_size=BLOCK,
        dummy_entry=0,
    )
    return q, k, v, meta


def _reference(q, k, v, meta, scale, scales):
    """Each row's attention in float32 over positions 0..pos of its plane."""
    heads, kv_heads = q.shape[1], k.shape[1]
    out = torch.empty(q.shape, dtype=torch.float32, device="cuda")
    k_scale, v_scale = scales if scales is not None else (None, None)
    for row in range(q.shape[0]):
        pos = int(meta.positions[row])
        j = torch.arange(pos + 1, device="cuda")
        blocks = meta.block_table[meta.row_tables[row], j // meta.block_size]
        entry = meta.read_plane[row] * meta.slots_per_plane + blocks * meta.block_size
        entry = entry + j % meta.block_size
        keys, values = k[entry].float(), v[entry].float()  # [ctx, kv_heads, dim]
        if k_scale is not None:
            keys, values = keys * k_scale[:, None], values * v_scale[:, None]
        keys = keys.repeat_interleave(heads // kv_heads, dim=1)
        values = values.repeat_interleave(heads // kv_heads, dim=1)
        scores = torch.einsum("hd,chd->hc", q[row].float(), keys) * scale
        out[row] = torch.einsum("hc,chd->hd", scores.softmax(-1), values)
    return out


def _combine(parts, v_scale, heads, kv_heads):
    """Split runs' (acc, max, sum) states combined in torch, as the Triton kernel does."""
    dim = parts.shape[-1] - 2
    acc, top, total = parts[..., :dim], parts[..., dim], parts[..., dim + 1]
    weight = torch.exp(top - top.max(-1, keepdim=True).values)
    out = (acc * weight[..., None]).sum(2) / (total * weight).sum(-1)[..., None]
    if v_scale is not None:
        out = out * v_scale.repeat_interleave(heads // kv_heads)[:, None]
    return out


CASES = [  # rows, context, heads, kv_heads, dim, splits
    (1, 1, 16, 16, 128, 1),
    (3, BLOCK, 16, 16, 128, 1),
    (16, BLOCK + 1, 16, 16, 128, 1),
    (17, 80, 16, 16, 128, 1),
    (64, 100, 16, 16, 128, 1),
    (255, 33, 16, 16, 128, 1),
    (3, 8192, 16, 16, 128, 4),
    (2, 8192, 16, 16, 128, 1),
    (5, 300, 16, 16, 128, 8),  # runs past the context: empty splits
    (1, 20, 55, 55, 96, 32),  # the most runs decode_splits takes, nearly all empty
    (2, 4096, 16, 16, 128, 32),
    (9, 200, 48, 8, 128, 1),  # Nanbeige: 6 heads a group (tile 8)
    (9, 200, 48, 8, 128, 2),
    (7, 150, 55, 55, 96, 1),  # Huginn-0125
    (7, 150, 8, 4, 64, 2),
    (4, 70, 16, 1, 64, 1),  # one KV head for 16 query heads: no tile, never taken
]


@pytest.mark.parametrize("kv", ["bf16", "e4m3", "e5m2", "e4m3_scaled"])
@pytest.mark.parametrize(("rows", "context", "heads", "kv_heads", "dim", "splits"), CASES)
def test_paged_decode_equals_float32_torch(rows, context, heads, kv_heads, dim, splits, kv):
    kv_dtype = {"bf16": torch.bfloat16, "e5m2": torch.float8_e5m2}.get(kv, torch.float8_e4m3fn)
    planes = 3
    q, k, v, meta = _problem(rows, context, heads, kv_heads, dim, kv_dtype, planes, rows + dim)
    fits = paged_attention_cuda.fits_cuda_decode(q, k, kv_heads)
    assert fits == (heads // kv_heads <= 8)
    if not fits:
        return
    scales = None
    if kv == "e4m3_scaled":  # far from 1 both ways: applied twice or not at all shows
        gen = torch.Generator(device="cuda").manual_seed(7)
        scales = tuple(0.05 + 4 * torch.rand(kv_heads, device="cuda", generator=gen) for _ in "kv")
    scale = dim**-0.5
    out = torch.full_like(q, float("nan"))
    parts = torch.full((rows, heads, splits, dim + 2), float("nan"), device="cuda")
    caches = (k, v, *(scales or (meta.positions, meta.positions)))
    args = (q, caches, scales is not None, out, parts if splits > 1 else out, meta, rows, splits)
    paged_attention_cuda.paged_decode(*args, None, scale, False)
    want = _reference(q, k, v, meta, scale, scales)
    if splits > 1:
        assert torch.isnan(out).all()  # the runs went to `parts` alone
        got = _combine(parts, scales[1] if scales else None, heads, kv_heads)
    else:
        got = out.float()
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)


def test_a_bounded_grid_takes_every_row_the_device_counts():
    """A captured pass's grid: 5 programs over the 37 rows counted on the device; rows past
    the count are left as they were."""
    q, k, v, meta = _problem(40, 90, 16, 16, 128, torch.bfloat16, 2, seed=3)
    out = torch.zeros_like(q)
    count = torch.tensor([37, 0], device="cuda")
    caches = (k, v, meta.positions, meta.positions)
    paged_attention_cuda.paged_decode(q, caches, False, out, out, meta, 5, 1, count, 0.1, False)
    want = _reference(q[:37], k, v, meta, 0.1, None)
    torch.testing.assert_close(out[:37].float(), want, atol=2e-2, rtol=2e-2)
    assert not out[37:].any()


@pytest.mark.parametrize("pdl", [False, True], ids=["plain", "pdl"])
def test_a_bounded_grid_that_counts_no_row_writes_nothing(pdl):
    """A prompt-only pass through a mixed graph: the device counts 0 decode rows. Launched
    as a programmatic dependent too (on Hopper), the blocks still wait and end."""
    if pdl and torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("programmatic dependent launch needs Hopper or newer")
    q, k, v, meta = _problem(8, 40, 55, 55, 96, torch.bfloat16, 1, seed=5)
    out = torch.zeros_like(q)
    count = torch.tensor([0, 3], device="cuda")
    caches = (k, v, meta.positions, meta.positions)
    paged_attention_cuda.paged_decode(q, caches, False, out, out, meta, 4, 1, count, 0.1, pdl)
    torch.cuda.synchronize()
    assert not out.any()


@pytest.mark.parametrize(
    ("planes", "table_planes"), [(4, 1), (1, 1), (1, 4)], ids=["last_exited", "shared", "sd"]
)
@pytest.mark.parametrize(
    "launch", ["plain", "bounded_grid", "many_rows", "two_kernels", "split_kv", "grouped"]
)
@pytest.mark.parametrize("kv", ["bf16", "fp8_scaled"])
@pytest.mark.parametrize("with_prompts", [True, False], ids=["mixed", "decode_only"])
def test_the_engine_op_attends_with_the_cuda_kernel(
    monkeypatch, planes, table_planes, launch, kv, with_prompts
):
    """TritonOps.attention with the CUDA row kernel, as the Triton one is tested: the same
    cache contents and outputs as the torch ops, and the kernel taken wherever the Triton
    row kernel would run (a decode-only pass of independent rows outside a bounded grid
    writes and attends in the fused Triton kernel instead)."""
    from vllm_rlt.ops.triton_ops import TritonOps

    calls = []
    launch_kernel = paged_attention_cuda.paged_decode
    monkeypatch.setattr(paged_attention_cuda, "ALL_ROWS", 1)
    monkeypatch.setattr(
        paged_attention_cuda, "paged_decode", lambda *a: calls.append(launch_kernel(*a))
    )
    kv_dtype, scaled = (None, False) if kv == "bf16" else (torch.float8_e4m3fn, True)
    kv_heads = 4 if launch == "grouped" else 16
    shape = (torch.bfloat16, planes, table_planes, kv_heads, with_prompts, launch)
    _check_attention(TritonOps(), monkeypatch, *shape, kv_dtype, scaled)
    fused = not with_prompts and launch not in ("two_kernels", "grouped", "bounded_grid")
    assert bool(calls) == (not fused)


@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim", "kv_dtype", "rows", "taken"),
    [
        (55, 55, 96, torch.bfloat16, 17, True),  # Huginn-0125: a head size Triton pads
        (55, 55, 96, torch.float8_e4m3fn, 64, True),
        (16, 16, 128, torch.bfloat16, 255, False),  # Ouro below 256 rows: Triton
        (16, 16, 128, torch.bfloat16, 256, True),  # and from 256 rows the kernel
        (16, 16, 128, torch.float8_e4m3fn, 255, False),
        (16, 16, 128, torch.float8_e4m3fn, 256, True),
        (48, 8, 128, torch.float8_e4m3fn, 512, False),  # grouped heads: Triton's tiles
    ],
)
def test_the_engine_takes_the_kernel_where_it_measured_faster(
    heads, kv_heads, dim, kv_dtype, rows, taken
):
    q = torch.zeros(rows, heads, dim, dtype=torch.bfloat16, device="cuda")
    k_cache = torch.zeros(64, kv_heads, dim, device="cuda").to(kv_dtype)
    assert paged_attention_cuda.takes_cuda_decode(q, k_cache, kv_heads, rows) == taken
