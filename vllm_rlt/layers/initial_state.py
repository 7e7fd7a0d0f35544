"""The initial state of a recurrence that starts from noise (Huginn-0125), drawn per
(request seed, position) with a counter-based hash: a position's draw does not depend on
how the prompt was chunked, which rows shared the pass or which device ran it, so a request
with a seed is reproducible, and a scale of 0 gives exact zeros. On CUDA with Triton, one
kernel takes the same steps (kernels/truncated_normal.py)."""

from __future__ import annotations

import math

import torch

from vllm_rlt.layers.sampler import seeded_uniform

# Mixed into the seed so the state's stream is not the sampler's (which hashes the same
# seed with the token index).
STATE_STREAM = 0x5EED_57A7_E000_0001
TRUNCATION = 3.0  # standard deviations on either side
LOW = 0.5 * math.erfc(TRUNCATION / math.sqrt(2))  # Phi(-3)


def truncated_normal(
    seeds: torch.Tensor,  # [rows] int64
    positions: torch.Tensor,  # [rows] int64
    width: int,
    std: float,
    scale: float = 1.0,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """[rows, width] draws of N(0, std^2) truncated to +-3 std, by inverting the normal CDF
    on hashed uniforms (float64 on the way), rounded to float32, times `scale` in float32,
    as `dtype`."""
    uniform = seeded_uniform(seeds ^ STATE_STREAM, positions, width)  # (0, 1), float64
    p = LOW + uniform * (1 - 2 * LOW)
    draw = (std * math.sqrt(2) * torch.erfinv(2 * p - 1)).float()
    return (draw * scale).to(dtype)
