"""Attention backend registry: a backend is a callable registered under a name."""

from __future__ import annotations

from collections.abc import Callable

import torch

from vllm_rlt.attention.metadata import AttentionMetadata

AttentionFn = Callable[
    [
        torch.Tensor,
        torch.Tensor,
        torch.Tensor,
        torch.Tensor,
        torch.Tensor,
        AttentionMetadata,
        float,
    ],
    torch.Tensor,
]

_BACKENDS: dict[str, tuple[Callable[[torch.device], bool], Callable[[], AttentionFn]]] = {}


def register_backend(
    name: str, is_available: Callable[[torch.device], bool], load: Callable[[], AttentionFn]
) -> None:
    _BACKENDS[name] = (is_available, load)


def available_backends(device: torch.device) -> list[str]:
    return [name for name, (ok, _) in _BACKENDS.items() if ok(device)]


def get_backend(name: str, device: torch.device) -> tuple[str, AttentionFn]:
    """Resolve `name` ("auto" picks the first available) to (resolved name, attention fn)."""
    if name == "auto":
        choices = available_backends(device)
        name = choices[0]
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


def _torch_backend() -> AttentionFn:
    from vllm_rlt.attention.torch_backend import paged_attention

    return paged_attention


register_backend("torch", lambda device: True, _torch_backend)
