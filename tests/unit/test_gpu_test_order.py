"""The GPU tier's order: long tests at the head of each xdist worker's share."""

from __future__ import annotations

from tests.gpu.conftest import long_first


def _shares(items: list, workers: int) -> list[list]:
    """The contiguous shares worksteal deals: each worker 1/n of what is left."""
    shares, left, start = [], len(items), 0
    for worker in range(workers):
        size = left // (workers - worker)
        shares.append(items[start : start + size])
        start, left = start + size, left - size
    return shares


def test_each_share_starts_with_its_long_tests_and_nothing_is_lost():
    items = [f"t{i}" for i in range(23)]
    long = {"t3", "t9", "t10", "t17", "t21", "t22"}
    ordered = long_first(items, lambda item: item in long, workers=4)
    assert sorted(ordered) == sorted(items)
    shares = _shares(ordered, 4)
    heads = [[item for item in share if item in long] for share in shares]
    assert [len(h) for h in heads] == [2, 2, 1, 1]
    for share, head in zip(shares, heads, strict=True):
        assert share[: len(head)] == head  # long ones first in every share
    short = [item for item in ordered if item not in long]
    assert short == [item for item in items if item not in long]  # the rest keep their order


def test_one_worker_runs_the_long_tests_first():
    ordered = long_first(list(range(10)), lambda item: item % 4 == 3, workers=1)
    assert ordered == [3, 7, 0, 1, 2, 4, 5, 6, 8, 9]


def test_more_long_tests_than_a_share_holds():
    items = list(range(6))
    ordered = long_first(items, lambda item: item < 5, workers=3)
    assert sorted(ordered) == items
    assert ordered[:2] == [0, 3]  # the first share: its two long ones
