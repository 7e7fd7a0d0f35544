"""Programmatic dependent launch (Hopper and newer): a kernel may start launching while its
predecessor in the stream finishes, and waits on the device, not on the launch, for that
predecessor's writes. In a decode pass of small kernels this hides most of the gap between
one kernel's tail and the next one's start."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def pdl_supported() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)


@triton.jit
def pdl_enter(USE_PDL: tl.constexpr):
    """First statement of every kernel launched with launch_pdl: wait until the previous
    kernel has finished and its writes are visible, then let the next kernel launch."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
