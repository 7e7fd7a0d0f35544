"""Small host-to-device uploads of a pass that need not wait for the device."""

from __future__ import annotations

import torch


class HostUploads:
    """Small int64 host-to-device uploads through a ring of pinned buffers, so they need not
    wait for the device. A buffer is reused only after later passes were collected: at most
    two passes are outstanding (one in flight, one being launched), and a pass uploads at
    most a dozen times (depth / 2)."""

    def __init__(self, size: int, device: torch.device, depth: int = 24) -> None:
        self.device = device
        pinned = device.type == "cuda"
        self.ring = [torch.empty(size, dtype=torch.int64, pin_memory=pinned) for _ in range(depth)]
        self.next = 0

    def upload(self, values, out: torch.Tensor | None = None) -> torch.Tensor:
        """`values` (a list of ints, or an int64 host tensor) on the device."""
        if not isinstance(values, torch.Tensor):
            values = torch.tensor(values, dtype=torch.int64)
        if self.device.type != "cuda":
            return values if out is None else out.copy_(values)
        if len(values) > self.ring[0].numel():
            # Grow the ring; a buffer an earlier copy still reads stays alive until it ends
            # (the pinned allocator tracks its stream use).
            size = 2 * len(values)
            self.ring = [torch.empty(size, dtype=torch.int64, pin_memory=True) for _ in self.ring]
        host = self.ring[self.next][: len(values)]
        self.next = (self.next + 1) % len(self.ring)
        host.copy_(values)
        if out is None:
            out = torch.empty(len(values), dtype=torch.int64, device=self.device)
        return out.copy_(host, non_blocking=True)
