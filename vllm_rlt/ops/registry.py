"""Backend registry: a backend supplies the fused ops of one loop (norms, activation,
RoPE + KV write + paged attention) for a kind of device."""

from __future__ import annotations

from collections.abc import Callable

import torch

from vllm_rlt.config import ParamError
from vllm_rlt.ops.base import LoopOps

# name: (is_available(device), load(), fits(head_dim), takes_fp8(device))
_BACKENDS: dict[
    str,
    tuple[
        Callable[[torch.device], bool],
        Callable[[], LoopOps],
        Callable[[int], bool],
        Callable[[torch.device], bool],
    ],
] = {}


def register_backend(
    name: str,
    is_available: Callable[[torch.device], bool],
    load: Callable[[], LoopOps],
    fits: Callable[[int], bool] = lambda head_dim: True,
    takes_fp8: Callable[[torch.device], bool] = lambda device: True,
) -> None:
    """`fits(head_dim)`: whether the backend's kernels take a model of that head size;
    `takes_fp8(device)`: whether they take float8 weights or K/V there."""
    _BACKENDS[name] = (is_available, load, fits, takes_fp8)


def available_backends(device: torch.device, head_dim: int | None = None) -> list[str]:
    return [
        name
        for name, (ok, _, fits, _) in _BACKENDS.items()
        if ok(device) and (head_dim is None or fits(head_dim))
    ]


def get_backend(
    name: str, device: torch.device, head_dim: int | None = None, fp8_setting: str | None = None
) -> tuple[str, LoopOps]:
    """Resolve `name` ("auto" picks the best available for the device and the model's
    `head_dim`) to (resolved name, ops object). `fp8_setting` names the setting that puts
    float8 weights or K/V in the engine, if any: a backend without float8 kernels on the
    device is an error naming it (not a silent switch to a slower backend)."""
    if name == "auto":
        name = available_backends(device, head_dim)[0]
    if name not in _BACKENDS:
        raise ValueError(
            f"attention_backend must be one of auto, {', '.join(_BACKENDS)}, got {name!r}"
        )
    is_available, load, fits, takes_fp8 = _BACKENDS[name]
    if not is_available(device):
        raise ValueError(
            f"attention_backend {name!r} is not available on device {device.type!r}; "
            f"available: {', '.join(available_backends(device))}"
        )
    if head_dim is not None and not fits(head_dim):
        raise ValueError(
            f"attention_backend {name!r} does not take head size {head_dim}; available for "
            f"it: {', '.join(available_backends(device, head_dim))}"
        )
    if fp8_setting is not None and not takes_fp8(device):
        raise ParamError(
            f"{fp8_setting}: float8 e4m3 needs compute capability 8.9 or newer (Ada, Hopper, "
            f"Blackwell) on the {name!r} attention backend, and this GPU is "
            f"{'.'.join(map(str, torch.cuda.get_device_capability(device)))}; leave "
            f"{fp8_setting} unset, or pass attention_backend 'torch' (plain torch ops, far "
            "slower)",
            fp8_setting,
        )
    return name, load()


def _triton_available(device: torch.device) -> bool:
    if device.type != "cuda":
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _triton_takes_fp8(device: torch.device) -> bool:
    """Triton's float8 e4m3 and FP8 tensor cores start at compute capability 8.9."""
    return torch.cuda.get_device_capability(device) >= (8, 9)


def _load_triton() -> LoopOps:
    from vllm_rlt.ops.triton_ops import TritonOps

    return TritonOps()


def _load_torch() -> LoopOps:
    from vllm_rlt.ops.torch_ops import TorchOps

    return TorchOps()


def _even(head_dim: int) -> bool:
    """The Triton kernels lay a head out on a power-of-two range of lanes, masked past its
    end (kernels/head_lanes.py), and rotate it in two halves of equal size: any even head
    size (Huginn's 96 as well as 64 or 128)."""
    return head_dim % 2 == 0


# Order matters: "auto" takes the first available.
register_backend("triton", _triton_available, _load_triton, _even, _triton_takes_fp8)
register_backend("torch", lambda device: True, _load_torch)
