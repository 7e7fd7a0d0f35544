"""Rotate-half rotary position embedding with a precomputed cos/sin table."""

from __future__ import annotations

import torch


class RotaryEmbedding:
    """Holds cos/sin for every position up to `max_positions`; loops reuse the same positions."""

    def __init__(
        self, head_dim: int, theta: float, max_positions: int, dtype: torch.dtype, device
    ) -> None:
        inv_freq = 1.0 / (
            theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
        )
        angles = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        angles = torch.cat([angles, angles], dim=-1)
        self.cos = angles.cos().to(dtype=dtype, device=device)  # [max_positions, head_dim]
        self.sin = angles.sin().to(dtype=dtype, device=device)  # [max_positions, head_dim]

    def apply(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotate x [rows, heads, head_dim] by the angle of each row's position [rows]."""
        cos = self.cos[positions].unsqueeze(1)  # [rows, 1, head_dim]
        sin = self.sin[positions].unsqueeze(1)
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rotated * sin
