"""Where top-k, top-p and min-p cut each row's distribution, found without a sort.

The filters keep a prefix of the row in the order (logit descending, token id ascending),
so one boundary says what survives: a token is kept when its logit is above the boundary's
value, or equal to it with an id at most the boundary's id. `layers.sampler.sample` finds
it by sorting the vocabulary (on an H100, most of a 3.6 ms sampler at 256 rows); here one
program per row searches for it instead. Logits are compared as int32 keys that order as
the floats do, and each search step reads the row once and counts (top-k) or weighs
(top-p) the tokens above PIVOTS keys at once, so a 32-bit key space is searched in about
10 reads. A boundary inside a run of equal logits is settled by a second search over ids.
The masses are float32 sums in another order than the sort's running sum, so a row whose
top_p lands within rounding of a token's mass above may keep one token more or less.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 512  # logits a program reads per step
PIVOTS = 8  # keys tried per read: each read narrows the search ninefold


@triton.jit
def order_key(x):
    """An int64 that orders as float32 `x` does (-0.0 as +0.0; NaN above +inf)."""
    bits = tl.where(x == 0.0, 0.0, x).to(tl.int32, bitcast=True)
    return tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).to(tl.int64)


@triton.jit
def _value(key):
    """The float32 whose key is `key` (an int64 from `order_key`)."""
    bits = key.to(tl.int32)
    return tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).to(tl.float32, bitcast=True)


@triton.jit
def _tally(
    row_ptr, vocab, top, pivots, tie_key,
    BY_ID: tl.constexpr, PIVOTS: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """Per pivot, how many tokens lie above it and their mass exp(x - top): with BY_ID,
    the tokens whose key is `tie_key` and whose id is at most the pivot instead."""
    cols = tl.arange(0, BLOCK)
    counts = tl.zeros((BLOCK, PIVOTS), tl.int32)
    masses = tl.zeros((BLOCK, PIVOTS), tl.float32)
    for start in range(0, vocab, BLOCK):
        offsets = start + cols
        inside = offsets < vocab
        x = tl.load(row_ptr + offsets, mask=inside, other=-float("inf"))
        keys = tl.where(inside, order_key(x), -(2**62))
        if BY_ID:
            hit = (keys == tie_key)[:, None] & (offsets.to(tl.int64)[:, None] <= pivots[None, :])
        else:
            hit = keys[:, None] > pivots[None, :]
        counts += hit.to(tl.int32)
        masses += tl.where(hit, tl.exp(x - top)[:, None], 0.0)
    return tl.sum(counts, axis=0), tl.sum(masses, axis=0)


@triton.jit
def _search(
    row_ptr, vocab, top, lo, lo_count, lo_mass, hi, hi_count, hi_mass,
    goal_count, goal_mass, tie_key,
    BY_MASS: tl.constexpr, BY_ID: tl.constexpr, PIVOTS: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """The least key (or, with BY_ID, id) in (lo, hi] whose tally above it is below the
    goal (a count, or with BY_MASS a mass), as long as hi's is, and the count and mass
    above it and above the key just before it: (key, count, mass, count before, mass
    before). Without BY_ID the tally is of tokens above; with it, of tokens whose key is
    tie_key and whose id is at most the candidate, and the goal is reached instead."""
    steps = tl.arange(1, PIVOTS + 1).to(tl.int64)
    while hi - lo > 1:
        pivots = lo + 1 + ((hi - lo - 1) * steps) // (PIVOTS + 1)
        counts, masses = _tally(row_ptr, vocab, top, pivots, tie_key, BY_ID, PIVOTS, BLOCK)
        if BY_ID:
            met = counts >= goal_count
        elif BY_MASS:
            met = masses < goal_mass
        else:
            met = counts < goal_count
        first = tl.min(tl.where(met, steps, PIVOTS + 1), axis=0)
        last = tl.max(tl.where(met, 0, steps), axis=0)
        if first <= PIVOTS:
            at = steps == first
            hi = tl.sum(tl.where(at, pivots, 0), axis=0)
            hi_count = tl.sum(tl.where(at, counts, 0), axis=0)
            hi_mass = tl.sum(tl.where(at, masses, 0.0), axis=0)
        if last > 0:
            at = steps == last
            lo = tl.sum(tl.where(at, pivots, 0), axis=0)
            lo_count = tl.sum(tl.where(at, counts, 0), axis=0)
            lo_mass = tl.sum(tl.where(at, masses, 0.0), axis=0)
    return hi, hi_count, hi_mass, lo_count, lo_mass


@triton.jit
def _filter_bound_kernel(
    x_ptr,  # [rows, vocab] float32 temperature-scaled logits (-inf: barred)
    stride,
    vocab,
    top_k_ptr,  # [rows] int64; 0 = every token
    top_p_ptr,  # [rows] float32; 1 = every token
    min_p_ptr,  # [rows] float32; 0 = every token
    key_ptr,  # [rows] int64 out: the boundary's key
    id_ptr,  # [rows] int64 out: the boundary's last id
    PIVOTS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = x_ptr + row * stride
    top_k = tl.load(top_k_ptr + row)
    top_p = tl.load(top_p_ptr + row)
    min_p = tl.load(min_p_ptr + row)
    by_k = (top_k > 0) & (top_k < vocab)
    count = tl.zeros((), tl.int32) + vocab
    last = count.to(tl.int64) - 1  # the last token id
    none = tl.zeros((), tl.int64) - 1  # below every token id
    nothing, zero = tl.zeros((), tl.int32), tl.zeros((), tl.float32)  # typed, for searches
    bound, last_id = tl.full((), -(2**31), tl.int64), last  # below every key: keep all
    if by_k | (top_p < 1.0) | (min_p > 0.0):
        cols = tl.arange(0, BLOCK)
        top = tl.full((), -float("inf"), tl.float32)
        low = tl.full((), 2**62, tl.int64)
        high = tl.full((), -(2**62), tl.int64)
        for start in range(0, vocab, BLOCK):
            offsets = start + cols
            inside = offsets < vocab
            x = tl.load(row_ptr + offsets, mask=inside, other=-float("inf"))
            keys = order_key(x)
            top = tl.maximum(top, tl.max(x, axis=0))
            low = tl.minimum(low, tl.min(tl.where(inside, keys, 2**62), axis=0))
            high = tl.maximum(high, tl.max(tl.where(inside, keys, -(2**62)), axis=0))
        # the least key whose exp(x - top) reaches min_p (the top's is 1), and the mass
        total = tl.full((), 0.0, tl.float32)
        floor = tl.full((), 2**62, tl.int64)
        for start in range(0, vocab, BLOCK):
            offsets = start + cols
            inside = offsets < vocab
            x = tl.load(row_ptr + offsets, mask=inside, other=-float("inf"))
            weight = tl.exp(x - top)
            total += tl.sum(weight, axis=0)
            reach = tl.where(weight >= min_p, order_key(x), 2**62)
            floor = tl.minimum(floor, tl.min(reach, axis=0))
        # top-k: the k-th key from the top (the least key with fewer than k tokens above)
        cut, cut_id = low, last
        cut_count, cut_mass = count, total  # tokens at or above `cut`, and their mass
        kept_mass = total
        if by_k:
            goal = top_k.to(tl.int32)
            cut, above, above_mass, cut_count, cut_mass = _search(
                row_ptr, vocab, top, low - 1, count, total, high, nothing, zero,
                goal, zero, none, False, False, PIVOTS, BLOCK,
            )  # fmt: skip
            ties = goal - above
            kept_mass = above_mass + ties.to(tl.float32) * tl.exp(_value(cut) - top)
            if ties < cut_count - above:
                cut_id, _, _, _, _ = _search(
                    row_ptr, vocab, top, none, nothing, zero, last, cut_count - above, zero,
                    ties, zero, cut, False, True, PIVOTS, BLOCK,
                )  # fmt: skip
        bound, last_id = cut, cut_id
        # top-p: the least key whose mass above stays below top_p of the top-k's mass
        if top_p < 1.0:
            goal_mass = top_p * kept_mass
            p_key, above, above_mass, at_or_above, _ = _search(
                row_ptr, vocab, top, cut - 1, cut_count, cut_mass, high, nothing, zero,
                nothing, goal_mass, none, True, False, PIVOTS, BLOCK,
            )  # fmt: skip
            # ties at p_key kept while the mass before each (above_mass + j * e) is short
            equal = at_or_above - above
            short = (goal_mass - above_mass) / tl.exp(_value(p_key) - top)
            ties = tl.minimum(tl.maximum(tl.ceil(short), 1.0), equal.to(tl.float32))
            ties = ties.to(tl.int32)
            if p_key > bound:
                bound, last_id = p_key, last
            if ties < equal:
                p_id, _, _, _, _ = _search(
                    row_ptr, vocab, top, none, nothing, zero, last, equal, zero,
                    ties, zero, p_key, False, True, PIVOTS, BLOCK,
                )  # fmt: skip
                last_id = tl.minimum(last_id, p_id)
        if floor > bound:
            bound, last_id = floor, last
    tl.store(key_ptr + row, bound)
    tl.store(id_ptr + row, last_id)


def filter_bound(
    scaled: torch.Tensor,  # [rows, vocab] float32 temperature-scaled logits, rows contiguous
    top_k: torch.Tensor,  # [rows] int64; 0 = every token
    top_p: torch.Tensor,  # [rows] float32; 1 = every token
    min_p: torch.Tensor,  # [rows] float32; 0 = every token
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's boundary ([rows] int64 key, [rows] int64 last id): the tokens top-k, top-p
    and min-p keep are those whose key is above the key, or equal to it with an id at most
    the last id (see `keys_of`); graph-safe."""
    rows, vocab = scaled.shape
    assert scaled.dtype == torch.float32 and scaled.stride(1) == 1
    keys = torch.empty(rows, dtype=torch.int64, device=scaled.device)
    ids = torch.empty(rows, dtype=torch.int64, device=scaled.device)
    if rows:
        _filter_bound_kernel[(rows,)](
            scaled,
            scaled.stride(0),
            vocab,
            top_k.contiguous(),
            top_p.float().contiguous(),
            min_p.float().contiguous(),
            keys,
            ids,
            PIVOTS=PIVOTS,
            BLOCK=BLOCK,
            num_warps=8,
        )
    return keys, ids


def keys_of(x: torch.Tensor) -> torch.Tensor:
    """The int64 keys `filter_bound` compares float32 `x` by (torch form, for checks)."""
    bits = torch.where(x == 0, 0.0, x).float().view(torch.int32)
    return torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).long()
