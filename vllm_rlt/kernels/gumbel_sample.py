"""Sampling with no filter in one read of each row's logits.

`layers.sampler.sample` sorts the whole vocabulary of every sampling row, because top-k,
top-p and min-p are defined on the sorted distribution: on an H200 it took 258 us at one
row and 2.9 ms at 256 rows (benchmarks/probe_sampler.py), even when no row filters. A row
that filters nothing draws the argmax of logits / temperature plus Gumbel noise, and that
argmax does not depend on the order tokens are visited in. Here programs stream runs of
each row's logits once (a second kernel picks each row's best run), hashing the same
counter-based noise as `seeded_uniform` (murmur3's finaliser on 32-bit words, then
-log(-log(u)) in float64), so they draw the very token the sort path draws for the same
seed and counter. As `token_stats`, they read the LM head's own dtype and the min_tokens
ban beside the logits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm_rlt.kernels.token_stats import ban_arguments, vocab_runs
from vllm_rlt.layers.sampler import TokenBan

BLOCK = 1024  # logits a program reads per step
# Each row's vocabulary is cut into runs (a power of two, at most MAX_RUNS, each at least
# BLOCK logits) until rows x runs reaches this many programs, and a second kernel picks each
# row's best run: one program per row streamed a 49,152-token row in ~172 us on an H100 at
# any row count up to 64, two float64 logs per logit on one SM.
RUN_PROGRAMS, MAX_RUNS = 256, 32


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
    logits_ptr,  # [rows, vocab] float32 or 16-bit floats
    stride,
    vocab,
    temperature_ptr,  # [rows] float32; 0 = greedy
    seed_ptr,  # [rows] int64
    counter_ptr,  # [rows] int64
    out_ptr,  # [rows] int64, or with RUNS > 1 [rows, RUNS] int64: each run's best token
    best_ptr,  # [rows, RUNS] float64: each run's best value (RUNS > 1)
    ban_ptr,  # [slots, vocab] uint8: 1 = banned (BAN)
    ban_stride,
    slot_ptr,  # [rows] int64 (BAN)
    active_ptr,  # [rows] uint8: 1 = the row's ban holds now (BAN)
    bound_ptr,  # [rows] float32: each row's filter boundary (BOUND, kernels/filter_bound.py)
    bound_id_ptr,  # [rows] int64
    SPAN: tl.constexpr,  # logits per run: a multiple of BLOCK
    RUNS: tl.constexpr,
    BAN: tl.constexpr,
    BOUND: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """The best token of run program_id(1) of row program_id(0)'s logits."""
    row = tl.program_id(0).to(tl.int64)
    run = tl.program_id(1)
    base_ptr = logits_ptr + row * stride
    if BAN:
        banned_row = ban_ptr + tl.load(slot_ptr + row) * ban_stride
        banning = tl.load(active_ptr + row) != 0
        ban_end = tl.where(banning, vocab, 0)  # rows whose ban is over read none of it
    if BOUND:
        bound = tl.load(bound_ptr + row)
        bound_id = tl.load(bound_id_ptr + row)
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
    for start in range(0, SPAN, BLOCK):
        offsets = run * SPAN + start + cols
        inside = offsets < vocab
        x = tl.load(base_ptr + offsets, mask=inside, other=-float("inf")).to(tl.float32)
        if BAN:
            banned = tl.load(banned_row + offsets, mask=offsets < ban_end, other=0)
            x = tl.where(banned != 0, -float("inf"), x)
        if BOUND:
            kept = (x > bound) | ((x == bound) & (offsets <= bound_id))
            x = tl.where(kept, x, -float("inf"))
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
    if RUNS == 1:
        tl.store(out_ptr + row, index)
    else:
        tl.store(out_ptr + row * RUNS + run, index)
        tl.store(best_ptr + row * RUNS + run, best)


@triton.jit
def _pick_run_kernel(best_ptr, index_ptr, out_ptr, RUNS: tl.constexpr):
    """Row program_id(0)'s token: the best run's, the earliest run on a tie (as argmax)."""
    row = tl.program_id(0).to(tl.int64)
    runs = tl.arange(0, RUNS)
    best = tl.load(best_ptr + row * RUNS + runs)
    top = tl.max(best, axis=0)
    run = tl.min(tl.where(best == top, runs, RUNS), axis=0)
    tl.store(out_ptr + row, tl.load(index_ptr + row * RUNS + run))


def gumbel_sample(
    logits: torch.Tensor,  # [rows, vocab] float32 or 16-bit floats, rows contiguous
    temperature: torch.Tensor,  # [rows] float32; 0 = greedy
    seeds: torch.Tensor,  # [rows] int64
    counters: torch.Tensor,  # [rows] int64
    ban: TokenBan | None = None,
    bound: tuple[torch.Tensor, torch.Tensor] | None = None,  # `filter_bound`'s, to keep
) -> torch.Tensor:
    """Tokens [rows] int64 (see LoopOps.sample_plain), drawn among the tokens `bound` keeps
    where given; graph-safe."""
    rows, vocab = logits.shape
    assert logits.is_floating_point() and logits.stride(1) == 1
    tokens = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if not rows:
        return tokens
    runs = vocab_runs(rows, vocab, RUN_PROGRAMS, BLOCK, MAX_RUNS)
    span = triton.cdiv(triton.cdiv(vocab, runs), BLOCK) * BLOCK
    index = tokens if runs == 1 else tokens.new_empty(rows, runs)
    best = logits if runs == 1 else logits.new_empty(rows, runs, dtype=torch.float64)
    _gumbel_sample_kernel[(rows, runs)](
        logits,
        logits.stride(0),
        vocab,
        temperature.float().contiguous(),
        seeds.contiguous(),
        counters.contiguous(),
        index,
        best,
        *ban_arguments(ban, logits),
        *(bound or (logits, logits)),
        SPAN=span,
        RUNS=runs,
        BAN=ban is not None,
        BOUND=bound is not None,
        BLOCK=BLOCK,
    )
    if runs > 1:
        _pick_run_kernel[(rows,)](best, index, tokens, RUNS=runs)
    return tokens
