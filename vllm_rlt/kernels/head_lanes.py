"""A head of any even size on a power-of-two range of lanes, as tl.arange needs: the launch
passes HEAD_P2 (`head_range`), and where it exceeds HEAD_DIM the lanes past the head are
masked, read as 0 (they add nothing to a dot product) and never stored. Where the range is
exact every lane mask is None, so a power-of-two head compiles to the code it did before
padding existed."""

from __future__ import annotations

import triton
import triton.language as tl


def head_range(head_dim: int) -> int:
    """HEAD_P2 of a head size: the next power of two, at least 16 (tl.dot's smallest side)."""
    return max(16, triton.next_power_of_2(head_dim))


@triton.jit
def real_lanes(d, SIZE: tl.constexpr, P2: tl.constexpr):
    """The lanes of `d` (offsets in a range of P2) that hold the head's SIZE values, or None
    where the range is exact."""
    lanes = None
    if P2 != SIZE:
        lanes = d < SIZE
    return lanes


@triton.jit
def with_lanes(mask, lanes):
    """`mask` bounded to the real lanes too (`lanes` of `real_lanes`, broadcast along the
    last axis)."""
    if lanes is not None:
        mask = mask & lanes
    return mask


@triton.jit
def load_lanes(ptrs, lanes):
    """tl.load(ptrs) where the lanes past the head (outside `lanes`, broadcast along the last
    axis) read as 0."""
    if lanes is None:
        x = tl.load(ptrs)
    else:
        mask, ptrs = tl.broadcast(lanes, ptrs)
        x = tl.load(ptrs, mask=mask, other=0.0)
    return x
