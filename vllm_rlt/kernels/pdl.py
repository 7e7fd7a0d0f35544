"""Programmatic dependent launch (Hopper and newer): a kernel may start launching while its
predecessor in the stream finishes, and waits on the device, not on the launch, for that
predecessor's writes. In a decode pass of small kernels this hides most of the gap between
one kernel's tail and the next one's start."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def pdl_supported(device: torch.device | None = None) -> bool:
    """Hopper or newer, and a Triton that has the griddepcontrol intrinsics (3.4+)."""
    if not torch.cuda.is_available() or not hasattr(tl.extra.cuda, "gdc_wait"):
        return False
    return torch.cuda.get_device_capability(device) >= (9, 0)


def launch_options(pdl: bool) -> dict:
    """Keyword arguments of a launch of a kernel that starts with pdl_enter: its USE_PDL, and
    `launch_pdl` only when used, so that a Triton without it still launches every kernel."""
    return {"USE_PDL": True, "launch_pdl": True} if pdl else {"USE_PDL": False}


@triton.jit
def pdl_enter(USE_PDL: tl.constexpr):
    """First statement of every kernel launched with launch_pdl: wait until the previous
    kernel has finished and its writes are visible, then let the next kernel launch."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
