"""Sampling with no filter in one read of each row's logits.

`layers.sampler.sample` sorts the whole vocabulary of every sampling row, because top-k,
top-p and min-p are defined on the sorted distribution: on an H200 it took 258 us at one
row and 2.9 ms at 256 rows (benchmarks/probe_sampler.py), even when no row filters. A row
that filters nothing draws the argmax of logits / temperature plus Gumbel noise, and that
argmax does not depend on the order tokens are visited in. Here one program per row
streams its logits once, hashing the same counter-based noise as `seeded_uniform` (murmur3's
finaliser on 32-bit words, then -log(-log(u)) in float64), so it draws the very token the
sort path draws for the same seed and counter.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024  # logits a program reads per step


@triton.jit
def _mix32(x):
    """murmur3's 32-bit finaliser on uint32 (products wrap modulo 2^32)."""
    x = x ^ (x >> 16)
    x = x * 0x85EBCA6B
    x = x ^ (x >> 13)
    x = x * 0xC2B2AE35
    return x ^ (x >> 16)


@triton.jit
def _gumbel_sample_kernel(
    logits_ptr,  # [rows, vocab] float32
    stride,
    vocab,
    temperature_ptr,  # [rows] float32; 0 = greedy
    seed_ptr,  # [rows] int64
    counter_ptr,  # [rows] int64
    out_ptr,  # [rows] int64
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    base_ptr = logits_ptr + row * stride
    temperature = tl.load(temperature_ptr + row)
    greedy = temperature == 0.0
    seed = tl.load(seed_ptr + row)
    counter = tl.load(counter_ptr + row)
    seed_lo = (seed & 0xFFFFFFFF).to(tl.uint32)
    seed_hi = ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
    stream = _mix32(_mix32(seed_lo ^ _mix32(seed_hi + 0x9E3779B9)) ^ counter.to(tl.uint32))
    divisor = tl.maximum(temperature, 1e-6)
    cols = tl.arange(0, BLOCK)
    best = tl.full((), -float("inf"), tl.float64)
    index = tl.full((), 0, tl.int64)
    for start in range(0, vocab, BLOCK):
        offsets = start + cols
        inside = offsets < vocab
        x = tl.load(base_ptr + offsets, mask=inside, other=-float("inf"))
        ids = _mix32(offsets.to(tl.uint32) + 0x632BE5AB)
        bits = _mix32(stream ^ ids)
        uniform = ((bits >> 8).to(tl.float64) + 0.5) / 16777216.0
        noise = -tl.log(-tl.log(uniform))
        # IEEE division, as torch divides (Triton's `/` on float32 is approximate)
        drawn = tl.math.div_rn(x, divisor).to(tl.float64) + noise
        value = tl.where(greedy, x.to(tl.float64), drawn)
        value = tl.where(inside, value, -float("inf"))
        block_best = tl.max(value, axis=0)
        first = tl.min(tl.where(value == block_best, offsets, vocab), axis=0).to(tl.int64)
        if block_best > best:  # a tie keeps the earlier token, as torch.argmax
            best = block_best
            index = first
    tl.store(out_ptr + row, index)


def gumbel_sample(
    logits: torch.Tensor,  # [rows, vocab] float32, rows contiguous
    temperature: torch.Tensor,  # [rows] float32; 0 = greedy
    seeds: torch.Tensor,  # [rows] int64
    counters: torch.Tensor,  # [rows] int64
) -> torch.Tensor:
    """Tokens [rows] int64 (see LoopOps.sample_plain); graph-safe."""
    rows, vocab = logits.shape
    assert logits.dtype == torch.float32 and logits.stride(1) == 1
    tokens = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows:
        _gumbel_sample_kernel[(rows,)](
            logits,
            logits.stride(0),
            vocab,
            temperature.float().contiguous(),
            seeds.contiguous(),
            counters.contiguous(),
            tokens,
            BLOCK=BLOCK,
        )
    return tokens
