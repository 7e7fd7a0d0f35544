"""Top-n-sigma filtering of temperature-scaled logits, in place, one program per row.

As torch ops the filter is about a dozen passes over [rows, vocab] whether or not a row
asks for it (on an H200, 73 us of a 331 us sampler at one row and 489 us of 3.4 ms at 256
rows, benchmarks/probe_sampler.py). Here a row whose n is not positive reads one number
and leaves; a row that filters reads its logits three times (count, sum and maximum of the
finite ones; the squared deviations; the masking) in one launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 2048  # logits a program reads per step


@triton.jit
def _top_n_sigma_kernel(
    x_ptr,  # [rows, vocab] float32, filtered in place
    n_ptr,  # [rows] float32
    stride,
    vocab,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    n = tl.load(n_ptr + row)
    if n > 0:
        base = x_ptr + row * stride
        cols = tl.arange(0, BLOCK)
        count = tl.full((), 0.0, tl.float32)
        total = tl.full((), 0.0, tl.float32)
        top = tl.full((), -float("inf"), tl.float32)
        for start in range(0, vocab, BLOCK):
            offsets = start + cols
            x = tl.load(base + offsets, mask=offsets < vocab, other=-float("inf"))
            finite = tl.abs(x) < float("inf")  # NaN and +-inf are not
            count += tl.sum(finite.to(tl.float32), axis=0)
            total += tl.sum(tl.where(finite, x, 0.0), axis=0)
            top = tl.maximum(top, tl.max(x, axis=0))
        mean = total / tl.maximum(count, 1.0)
        squares = tl.full((), 0.0, tl.float32)
        for start in range(0, vocab, BLOCK):
            offsets = start + cols
            x = tl.load(base + offsets, mask=offsets < vocab, other=-float("inf"))
            centred = tl.where(tl.abs(x) < float("inf"), x - mean, 0.0)
            squares += tl.sum(centred * centred, axis=0)
        floor = top - n * tl.sqrt(squares / tl.maximum(count - 1.0, 1.0))
        for start in range(0, vocab, BLOCK):
            offsets = start + cols
            inside = offsets < vocab
            x = tl.load(base + offsets, mask=inside, other=0.0)
            tl.store(base + offsets, tl.where(x < floor, -float("inf"), x), mask=inside)


def top_n_sigma_(
    scaled: torch.Tensor,  # [rows, vocab] float32, rows contiguous; filtered in place
    n: torch.Tensor,  # [rows] float32; rows with n <= 0 are left as they are
) -> torch.Tensor:
    """`scaled` with -inf where a logit lies more than n standard deviations (of the row's
    finite logits) below the row's largest; graph-safe."""
    rows, vocab = scaled.shape
    assert scaled.dtype == torch.float32 and scaled.stride(1) == 1
    if rows:
        _top_n_sigma_kernel[(rows,)](
            scaled, n.float().contiguous(), scaled.stride(0), vocab, BLOCK=BLOCK
        )
    return scaled
