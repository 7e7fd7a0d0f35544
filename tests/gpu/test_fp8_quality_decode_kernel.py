"""benchmarks/fp8_quality.py's decode-kernel variants: every position attended as a decode
row of the CUDA kernel over a float8 cache equals causal attention over the K/V that cache
reads back, unscaled and with per-head scales, in one run and in split runs."""

from __future__ import annotations

import pytest
import torch

from benchmarks.fp8_quality import _dense_attention, kernel_attention
from vllm_rlt.kernels import cuda_build, paged_attention_cuda

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
if cuda_build.find_nvcc() is None:
    pytest.skip("needs nvcc to build the CUDA kernels", allow_module_level=True)


@pytest.mark.parametrize("scaled", [False, True], ids=["scale1", "per_head"])
@pytest.mark.parametrize(("batch", "length"), [(1, 17), (3, 40), (4, 128)])
def test_kernel_attention_equals_dense_over_the_float8_cache(batch, length, scaled):
    gen = torch.Generator(device="cuda").manual_seed(batch * length)
    heads, kv_heads, dim = 16, 16, 128
    q, k, v = (
        torch.randn(batch * length, h, dim, device="cuda", generator=gen).to(torch.bfloat16)
        for h in (heads, kv_heads, kv_heads)
    )
    scales = None
    if scaled:  # as the benchmark calibrates them: the largest |K| to 200, |V| to 100
        scales = tuple(t.abs().amax((0, 2)).float() / r for t, r in ((k, 200), (v, 100)))
    got = kernel_attention(q, k, v, batch, scales).view(batch * length, -1)
    want = _dense_attention(q.float(), k.float(), v.float(), batch, True, scales)
    error = (got.float() - want).norm() / want.norm()
    assert error < 1e-2, error
    # 17 rows split their runs (and some runs are empty); 120 and 512 rows take one
    splits = paged_attention_cuda.decode_splits(batch * length, kv_heads)
    assert (splits > 1) == (batch * length < 64)
