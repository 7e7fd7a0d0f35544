"""The initial state of a recurrence that starts from noise (Huginn-0125), drawn per
(request seed, position) with a counter-based hash: a position's draw does not depend on
how the prompt was chunked, which rows shared the pass or which device ran it, so a request
with a seed is reproducible, and a scale of 0 gives exact zeros."""

from __future__ import annotations

import math

import torch

from vllm_rlt.layers.sampler import seeded_uniform

# Mixed into the seed so the state's stream is not the sampler's (which hashes the same
# seed with the token index).
STATE_STREAM = 0x5EED_57A7_E000_0001
TRUNCATION = 3.0  # standard deviations on either side


def truncated_normal(
    seeds: torch.Tensor,  # [rows] int64
    positions: torch.Tensor,  # [rows] int64
    width: int,
    std: float,
) -> torch.Tensor:
    """[rows, width] float32 draws of N(0, std^2) truncated to +-3 std, by inverting the
    normal CDF on hashed uniforms (float64 on the way)."""
    uniform = seeded_uniform(seeds ^ STATE_STREAM, positions, width)  # (0, 1), float64
    low = 0.5 * math.erfc(TRUNCATION / math.sqrt(2))  # Phi(-3)
    p = low + uniform * (1 - 2 * low)
    return (std * math.sqrt(2) * torch.erfinv(2 * p - 1)).float()
