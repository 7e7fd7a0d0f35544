"""Shared fixtures of the GPU tests."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def exact_float32():
    """float32 matmuls without TF32, for comparisons with the CPU oracle."""
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = previous
