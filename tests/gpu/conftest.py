"""Shared fixtures of the GPU tests, and their order: long ones first."""

from __future__ import annotations

import os

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    """Start the `long` tests first, one at the head of each worker's share: xdist's
    worksteal hands each worker a contiguous share of the list, and a test of minutes begun
    late holds up the end of the run."""
    if torch.cuda.is_available():
        workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
        items[:] = long_first(items, lambda item: "long" in item.keywords, workers)


def long_first(items: list, is_long, workers: int) -> list:
    """`items` cut into `workers` shares of the sizes worksteal gives them (each a 1/n of
    what is left), the long items dealt out one to a share in turn at the share's head."""
    long = [item for item in items if is_long(item)]
    rest = iter([item for item in items if not is_long(item)])
    ordered, left = [], len(items)
    for share in range(workers):
        size = left // (workers - share)
        left -= size
        heads = long[share::workers]
        ordered += heads + [next(rest) for _ in range(max(0, size - len(heads)))]
    return ordered + list(rest)


@pytest.fixture
def exact_float32():
    """float32 matmuls without TF32, for comparisons with the CPU oracle."""
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = previous
