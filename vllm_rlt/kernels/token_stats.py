"""The sampled token's logprob and rank in one read of each row's logits.

The pass head needs, for every sampling row, the logprob of its token and its rank among
all tokens (vLLM's `Logprob.rank`: 1 + the tokens at least as likely). As torch ops that
is a log-softmax written in full, a gather, a comparison written in full and a sum: about
five passes over [rows, vocab] float32 (50 MB at 256 rows of Ouro's vocabulary). Here one
program per row streams its logits once with an online maximum and sum of exponentials,
counting the logits at least the token's; for an all-greedy pass it also finds the token
(the first maximum, as torch.argmax), its rank then being the count of logits equal to it.

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

BLOCK = 2048  # logits a program reads per step


@triton.jit
def _token_stats_kernel(
    logits_ptr,  # [rows, vocab] float32 or bfloat16 / float16
    stride,
    vocab,
    tokens_ptr,  # [rows] int64: read unless GREEDY, written if GREEDY
    logprob_ptr,  # [rows] float32
    rank_ptr,  # [rows] int64
    ban_ptr,  # [slots, vocab] uint8: 1 = banned (BAN)
    ban_stride,
    slot_ptr,  # [rows] int64: each row's slot in the ban table (BAN)
    active_ptr,  # [rows] uint8: 1 = the row's ban holds now (BAN)
    GREEDY: tl.constexpr,
    BAN: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride
    cols = tl.arange(0, BLOCK)
    if BAN:
        banned_row = ban_ptr + tl.load(slot_ptr + row) * ban_stride
        banning = tl.load(active_ptr + row) != 0
        ban_end = tl.where(banning, vocab, 0)  # rows whose ban is over read none of it
    if GREEDY:
        chosen = tl.full((), -float("inf"), tl.float32)
        index = tl.full((), 0, tl.int64)
    else:
        index = tl.load(tokens_ptr + row)
        chosen = tl.load(base + index).to(tl.float32)
        if BAN:  # a banned token given anyway (never by the engine) has logprob -inf
            barred = banning & (tl.load(banned_row + index) != 0)
            chosen = tl.where(barred, -float("inf"), chosen)
    top = tl.full((), -float("inf"), tl.float32)  # the running maximum
    total = tl.full((), 0.0, tl.float32)  # sum of exp(x - top)
    count = tl.full((), 0, tl.int64)  # GREEDY: logits equal to `top`; else logits >= chosen
    for start in range(0, vocab, BLOCK):
        offsets = start + cols
        inside = offsets < vocab
        x = tl.load(base + offsets, mask=inside, other=-float("inf")).to(tl.float32)
        if BAN:
            banned = tl.load(banned_row + offsets, mask=offsets < ban_end, other=0)
            x = tl.where(banned != 0, -float("inf"), x)
        block_top = tl.max(x, axis=0)
        new_top = tl.maximum(top, block_top)
        # -inf - -inf is NaN: a block (or row so far) of -inf adds nothing
        scale = tl.where(top == new_top, 1.0, tl.exp(top - new_top))
        terms = tl.where(x == -float("inf"), 0.0, tl.exp(x - new_top))
        total = total * scale + tl.sum(terms, axis=0)
        if GREEDY:
            at_top = x == block_top
            first = tl.min(tl.where(at_top, offsets, vocab), axis=0).to(tl.int64)
            ties = tl.sum(at_top.to(tl.int64), axis=0)
            if block_top > top:
                index = first
                count = ties
            elif block_top == top:
                count += ties
        else:
            count += tl.sum(((x >= chosen) & inside).to(tl.int64), axis=0)  # chosen may be -inf
        top = new_top
    if GREEDY:
        chosen = top
        tl.store(tokens_ptr + row, index)
    tl.store(logprob_ptr + row, chosen - top - tl.log(total))
    tl.store(rank_ptr + row, count)


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
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tokens, their logprobs [rows] float32, their ranks [rows] int64) of the logits
    with `ban` applied; graph-safe."""
    rows, vocab = logits.shape
    assert logits.is_floating_point() and logits.stride(1) == 1
    greedy = tokens is None
    tokens = logits.new_empty(rows, dtype=torch.int64) if greedy else tokens.contiguous()
    logprobs = logits.new_empty(rows, dtype=torch.float32)
    ranks = logits.new_empty(rows, dtype=torch.int64)
    if rows:
        _token_stats_kernel[(rows,)](
            logits,
            logits.stride(0),
            vocab,
            tokens,
            logprobs,
            ranks,
            *ban_arguments(ban, logits),
            GREEDY=greedy,
            BAN=ban is not None,
            BLOCK=BLOCK,
        )
    return tokens, logprobs, ranks
