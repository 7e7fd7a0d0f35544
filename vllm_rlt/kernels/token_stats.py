"""The sampled token's logprob and rank in one read of each row's logits.

The pass head needs, for every sampling row, the logprob of its token and its rank among
all tokens (vLLM's `Logprob.rank`: 1 + the tokens at least as likely). As torch ops that
is a log-softmax written in full, a gather, a comparison written in full and a sum: about
five passes over [rows, vocab] float32 (50 MB at 256 rows of Ouro's vocabulary). Here one
program per row streams its logits once with an online maximum and sum of exponentials,
counting the logits at least the token's; for an all-greedy pass it also finds the token
(the first maximum, as torch.argmax), its rank then being the count of logits equal to it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 2048  # logits a program reads per step


@triton.jit
def _token_stats_kernel(
    logits_ptr,  # [rows, vocab] float32
    stride,
    vocab,
    tokens_ptr,  # [rows] int64: read unless GREEDY, written if GREEDY
    logprob_ptr,  # [rows] float32
    rank_ptr,  # [rows] int64
    GREEDY: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride
    cols = tl.arange(0, BLOCK)
    if GREEDY:
        chosen = tl.full((), -float("inf"), tl.float32)
        index = tl.full((), 0, tl.int64)
    else:
        index = tl.load(tokens_ptr + row)
        chosen = tl.load(base + index)
    top = tl.full((), -float("inf"), tl.float32)  # the running maximum
    total = tl.full((), 0.0, tl.float32)  # sum of exp(x - top)
    count = tl.full((), 0, tl.int64)  # GREEDY: logits equal to `top`; else logits >= chosen
    for start in range(0, vocab, BLOCK):
        offsets = start + cols
        x = tl.load(base + offsets, mask=offsets < vocab, other=-float("inf"))
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
            count += tl.sum((x >= chosen).to(tl.int64), axis=0)
        top = new_top
    if GREEDY:
        chosen = top
        tl.store(tokens_ptr + row, index)
    tl.store(logprob_ptr + row, chosen - top - tl.log(total))
    tl.store(rank_ptr + row, count)


def token_stats(
    logits: torch.Tensor,  # [rows, vocab] float32, rows contiguous
    tokens: torch.Tensor | None,  # [rows] int64; None: each row's argmax
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tokens, their logprobs [rows] float32, their ranks [rows] int64); graph-safe."""
    rows, vocab = logits.shape
    assert logits.dtype == torch.float32 and logits.stride(1) == 1
    greedy = tokens is None
    tokens = logits.new_empty(rows, dtype=torch.int64) if greedy else tokens.contiguous()
    logprobs = logits.new_empty(rows)
    ranks = logits.new_empty(rows, dtype=torch.int64)
    if rows:
        _token_stats_kernel[(rows,)](
            logits, logits.stride(0), vocab, tokens, logprobs, ranks, GREEDY=greedy, BLOCK=BLOCK
        )
    return tokens, logprobs, ranks
