"""The sampled token's logprob and rank in one read of each row's logits.

The pass head needs, for every sampling row, the logprob of its token and its rank among
all tokens (vLLM's `Logprob.rank`: 1 + the tokens at least as likely). As torch ops that
is a log-softmax written in full, a gather, a comparison written in full and a sum: about
five passes over [rows, vocab] float32 (50 MB at 256 rows of Ouro's vocabulary). Here
programs stream runs of each row's logits once with an online maximum and sum of
exponentials, counting the logits at least the token's (a second kernel combines a row's
runs); for an all-greedy pass they also find the token (the first maximum, as
torch.argmax), its rank then being the count of logits equal to it. A row that samples
nothing in the pass (`live`) reads none of its logits.

The logits may stay in the LM head's own dtype (bfloat16 widens to float32 exactly, so the
numbers are those of the float32 copy, which is never written), and the min_tokens ban is
read beside them (`ban`) instead of being written into a masked copy: at 512 rows of
Ouro's vocabulary the widening, the copy and the masking were three passes over 100 MB.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from vllm_rlt.layers.sampler import TokenBan

BLOCK = 1024  # logits a program reads per step
# Each row's vocabulary is cut into runs (a power of two, at most MAX_RUNS, each at least
# BLOCK logits) until rows x runs reaches RUN_PROGRAMS, and a second kernel combines each
# row's runs: one program per row took 29 us for one row of 49,152 logits on an H100 (24
# dependent steps), the same at 1 row as at 64, and 52 us at 512 rows (0.32 of bandwidth).
RUN_PROGRAMS, MAX_RUNS = 2048, 32


@triton.jit
def _token_stats_kernel(
    logits_ptr,  # [rows, vocab] float32 or bfloat16 / float16
    stride,
    vocab,
    tokens_ptr,  # [rows] int64: read unless GREEDY, written if GREEDY
    logprob_ptr,  # [rows] float32 (RUNS > 1 and not GREEDY: run 0 leaves the token's logit)
    rank_ptr,  # [rows] int64
    top_ptr,  # [rows, RUNS] float32: each run's largest logit (RUNS > 1)
    total_ptr,  # [rows, RUNS] float32: each run's sum of exp(x - its largest)
    first_ptr,  # [rows, RUNS] int64: each run's first largest (GREEDY)
    count_ptr,  # [rows, RUNS] int64: GREEDY: its logits equal to its largest; else >= token's
    ban_ptr,  # [slots, vocab] uint8: 1 = banned (BAN)
    ban_stride,
    slot_ptr,  # [rows] int64: each row's slot in the ban table (BAN)
    active_ptr,  # [rows] uint8: 1 = the row's ban holds now (BAN)
    live_ptr,  # [rows] uint8: 0 = the row samples nothing: read none of it (LIVE)
    GREEDY: tl.constexpr,
    BAN: tl.constexpr,
    LIVE: tl.constexpr,
    SPAN: tl.constexpr,  # logits per run: a multiple of BLOCK
    RUNS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Run program_id(1) of row program_id(0); with one run, the row's results."""
    row = tl.program_id(0).to(tl.int64)
    run = tl.program_id(1)
    base = logits_ptr + row * stride
    cols = tl.arange(0, BLOCK)
    lo = run * SPAN
    hi = tl.minimum(lo + SPAN, vocab)
    live = True
    if LIVE:
        live = tl.load(live_ptr + row) != 0
        hi = tl.where(live, hi, lo)
    if BAN:
        banned_row = ban_ptr + tl.load(slot_ptr + row) * ban_stride
        ban_end = tl.where(tl.load(active_ptr + row) != 0, hi, lo)  # read only while it holds
    if GREEDY:
        chosen = tl.full((), -float("inf"), tl.float32)
        index = tl.full((), 0, tl.int64)
    else:
        index = tl.load(tokens_ptr + row)
        chosen = tl.load(base + index).to(tl.float32)
        if BAN:  # a banned token given anyway (never by the engine) has logprob -inf
            banning = tl.load(active_ptr + row) != 0
            barred = banning & (tl.load(banned_row + index) != 0)
            chosen = tl.where(barred, -float("inf"), chosen)
    top = tl.full((), -float("inf"), tl.float32)  # the running maximum
    total = tl.full((), 0.0, tl.float32)  # sum of exp(x - top)
    count = tl.full((), 0, tl.int64)  # GREEDY: logits equal to `top`; else logits >= chosen
    for start in range(lo, hi, BLOCK):
        offsets = start + cols
        inside = offsets < hi
        x = tl.load(base + offsets, mask=inside, other=-float("inf")).to(tl.float32)
        if BAN:
            banned = tl.load(banned_row + offsets, mask=offsets < ban_end, other=0)
            x = tl.where(banned != 0, -float("inf"), x)
        block_top = tl.max(x, axis=0)
        new_top = tl.maximum(top, block_top)
        # -inf - -inf is NaN: a block (or run so far) of -inf adds nothing
        scale = tl.where(top == new_top, 1.0, tl.exp(top - new_top))
        terms = tl.where(x == -float("inf"), 0.0, tl.exp(x - new_top))
        total = total * scale + tl.sum(terms, axis=0)
        if GREEDY:
            at_top = tl.where(inside, x == block_top, False)
            first = tl.min(tl.where(at_top, offsets, vocab), axis=0).to(tl.int64)
            ties = tl.sum(at_top.to(tl.int64), axis=0)
            if block_top > top:
                index = first
                count = ties
            elif block_top == top:
                count += ties
        else:  # chosen may be -inf: count only the logits inside the run
            count += tl.sum(tl.where(inside, x >= chosen, False).to(tl.int64), axis=0)
        top = new_top
    if RUNS == 1:
        if GREEDY:
            chosen = top
            tl.store(tokens_ptr + row, tl.where(live, index, 0))
        tl.store(logprob_ptr + row, tl.where(live, chosen - top - tl.log(total), 0.0))
        tl.store(rank_ptr + row, tl.where(live, count, 0))
    else:
        at = row * RUNS + run
        tl.store(top_ptr + at, top)
        tl.store(total_ptr + at, total)
        tl.store(count_ptr + at, count)
        if GREEDY:
            tl.store(first_ptr + at, index)
        elif run == 0:
            tl.store(logprob_ptr + row, chosen)


@triton.jit
def _combine_runs_kernel(
    top_ptr,
    total_ptr,
    first_ptr,
    count_ptr,  # [rows, RUNS] each, as _token_stats_kernel left them
    tokens_ptr,
    logprob_ptr,  # [rows]: not GREEDY: the token's logit in, its logprob out
    rank_ptr,
    live_ptr,
    GREEDY: tl.constexpr,
    LIVE: tl.constexpr,
    RUNS: tl.constexpr,
):
    """Row program_id(0)'s results from its runs: the largest logit of all, the sum of
    exponentials rescaled to it, and (GREEDY) the earliest run holding it, as argmax."""
    row = tl.program_id(0).to(tl.int64)
    runs = tl.arange(0, RUNS)
    tops = tl.load(top_ptr + row * RUNS + runs)
    counts = tl.load(count_ptr + row * RUNS + runs)
    top = tl.max(tops, axis=0)
    weights = tl.where(tops == -float("inf"), 0.0, tl.exp(tops - top))
    total = tl.sum(tl.load(total_ptr + row * RUNS + runs) * weights, axis=0)
    live = True
    if LIVE:
        live = tl.load(live_ptr + row) != 0
    if GREEDY:
        at_top = tops == top
        run = tl.min(tl.where(at_top, runs, RUNS), axis=0)
        index = tl.load(first_ptr + row * RUNS + run)
        count = tl.sum(tl.where(at_top, counts, 0), axis=0)
        chosen = top
        tl.store(tokens_ptr + row, tl.where(live, index, 0))
    else:
        count = tl.sum(counts, axis=0)
        chosen = tl.load(logprob_ptr + row)
    tl.store(logprob_ptr + row, tl.where(live, chosen - top - tl.log(total), 0.0))
    tl.store(rank_ptr + row, tl.where(live, count, 0))


def vocab_runs(rows: int, vocab: int, programs: int, block: int, max_runs: int) -> int:
    """Runs per row: a power of two, at most `max_runs`, each of at least `block` logits,
    doubled while rows x runs x 2 stays within `programs`; fixed by the row count and the
    vocabulary, as a captured graph needs."""
    runs = 1
    while runs < max_runs and rows * runs * 2 <= programs and vocab > runs * 2 * block:
        runs *= 2
    return runs


def ban_arguments(ban: TokenBan | None, like: torch.Tensor) -> tuple[Any, ...]:
    """The (table, its row stride, slots, active) kernel arguments of `ban`, or stand-ins
    (`like`, any device tensor) that a kernel compiled without the ban never reads."""
    if ban is None:
        return like, 0, like, like
    table = ban.table.view(torch.uint8)
    active = ban.active.contiguous().view(torch.uint8)
    return table, table.stride(0), ban.slots.contiguous(), active


def token_stats(
    logits: torch.Tensor,  # [rows, vocab] float32 or 16-bit floats, rows contiguous
    tokens: torch.Tensor | None,  # [rows] int64; None: each row's argmax
    ban: TokenBan | None = None,
    live: torch.Tensor | None = None,  # [rows] bool; rows not live come back as zeros
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tokens, their logprobs [rows] float32, their ranks [rows] int64) of the logits
    with `ban` applied; graph-safe."""
    rows, vocab = logits.shape
    assert logits.is_floating_point() and logits.stride(1) == 1
    greedy = tokens is None
    tokens = logits.new_empty(rows, dtype=torch.int64) if greedy else tokens.contiguous()
    logprobs = logits.new_empty(rows, dtype=torch.float32)
    ranks = logits.new_empty(rows, dtype=torch.int64)
    if not rows:
        return tokens, logprobs, ranks
    runs = vocab_runs(rows, vocab, RUN_PROGRAMS, BLOCK, MAX_RUNS)
    span = triton.cdiv(triton.cdiv(vocab, runs), BLOCK) * BLOCK
    partial = [logprobs] * 2 + [ranks] * 2  # stand-ins a single run never writes
    if runs > 1:
        partial = [logits.new_empty(rows, runs, dtype=torch.float32) for _ in range(2)]
        partial += [logits.new_empty(rows, runs, dtype=torch.int64) for _ in range(2)]
    flags = live.contiguous().view(torch.uint8) if live is not None else logprobs
    _token_stats_kernel[(rows, runs)](
        logits,
        logits.stride(0),
        vocab,
        tokens,
        logprobs,
        ranks,
        *partial,
        *ban_arguments(ban, logits),
        flags,
        GREEDY=greedy,
        BAN=ban is not None,
        LIVE=live is not None,
        SPAN=span,
        RUNS=runs,
        BLOCK=BLOCK,
    )
    if runs > 1:
        _combine_runs_kernel[(rows,)](
            *partial,
            tokens,
            logprobs,
            ranks,
            flags,
            GREEDY=greedy,
            LIVE=live is not None,
            RUNS=runs,
        )
    return tokens, logprobs, ranks
