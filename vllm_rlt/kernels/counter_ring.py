"""Counters in device memory on which CUDA kernels count their finished units instead of
waiting for the kernel before them: zero between launches (each launch zeroes its own),
and each launch takes the next block of them in turn, so launches in flight together (one
waiting at a programmatic-dependent-launch wait, the other ending) never share one."""

from __future__ import annotations

import itertools

import torch


class CounterRing:
    """`launches` blocks of `per_launch` int32 counters per device, taken in turn."""

    def __init__(self, owner: str, per_launch: int, launches: int) -> None:
        self.owner, self.per_launch, self.launches = owner, per_launch, launches
        self._rings: dict[torch.device, tuple[torch.Tensor, itertools.count]] = {}

    def next_address(self, device: torch.device) -> int:
        """The address of the next launch's counters on `device` (allocated and zeroed on
        first use, which must come before any capture: a zero-fill captured would not run
        now)."""
        if device not in self._rings:
            if torch.cuda.is_current_stream_capturing():
                raise RuntimeError(f"{self.owner}: run it once before capturing a graph")
            ring = torch.zeros(self.launches * self.per_launch, dtype=torch.int32, device=device)
            self._rings[device] = ring, itertools.count()
        ring, turn = self._rings[device]
        return ring.data_ptr() + 4 * self.per_launch * (next(turn) % self.launches)

    def counters(self, device: torch.device) -> torch.Tensor:
        """Every counter on `device` (all zero when no launch is in flight)."""
        return self._rings[device][0]
