"""Backend registry: a backend supplies the fused ops of one loop (norms, activation,
RoPE + KV write + paged attention) for a kind of device."""

from __future__ import annotations

from collections.abc import Callable

import torch

from vllm_rlt.ops.base import LoopOps

_BACKENDS: dict[str, tuple[Callable[[torch.device], bool], Callable[[], LoopOps]]] = {}


def register_backend(
    name: str, is_available: Callable[[torch.device], bool], load: Callable[[], LoopOps]
) -> None:
    _BACKENDS[name] = (is_available, load)


def available_backends(device: torch.device) -> list[str]:
    return [name for name, (ok, _) in _BACKENDS.items() if ok(device)]


def get_backend(name: str, device: torch.device) -> tuple[str, LoopOps]:
    """Resolve `name` ("auto" picks the best available) to (resolved name, ops object)."""
    if name == "auto":
        name = available_backends(device)[0]
    if name not in _BACKENDS:
        raise ValueError(
            f"attention_backend must be one of auto, {', '.join(_BACKENDS)}, got {name!r}"
        )
    is_available, load = _BACKENDS[name]
    if not is_available(device):
        raise ValueError(
            f"attention_backend {name!r} is not available on device {device.type!r}; "
            f"available: {', '.join(available_backends(device))}"
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


def _load_triton() -> LoopOps:
    from vllm_rlt.ops.triton_ops import TritonOps

    return TritonOps()


def _load_torch() -> LoopOps:
    from vllm_rlt.ops.torch_ops import TorchOps

    return TorchOps()


# Order matters: "auto" takes the first available.
register_backend("triton", _triton_available, _load_triton)
register_backend("torch", lambda device: True, _load_torch)
