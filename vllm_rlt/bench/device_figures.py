"""What a benchmark's figures are measured against: the software and the device they ran on,
and on CUDA the memory-bandwidth roofline of a decode pass."""

from __future__ import annotations

import platform
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch loads when a run starts, not to parse flags
    import torch


def copy_bandwidth(device: torch.device) -> float:
    """Measured device memory bandwidth in bytes/s (a 1 GiB copy reads and writes it)."""
    import torch

    source = torch.empty(2**29, dtype=torch.float16, device=device)
    target = torch.empty_like(source)
    for _ in range(3):
        target.copy_(source)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        target.copy_(source)
    end.record()
    end.synchronize()
    return 2 * source.numel() * source.element_size() * 10 / (start.elapsed_time(end) / 1e3)


def roofline(model, args, concurrency: int, mean_loops: float, bandwidth: float) -> dict:
    """Decode tokens/s if a token only streamed what it needs once (the model's
    `streamed_bytes`: the looped weights and each looped layer's keys and values, one
    plane, at the mean context, every loop; the rest once per token), shared by the
    concurrent rows, at the measured bandwidth."""
    from vllm_rlt.layers.fp8 import kv_cache_torch_dtype

    cfg = model.config
    kv_element = kv_cache_torch_dtype(args.kv_cache_dtype, model.dtype).itemsize
    mean_context = args.shared_prefix_len + args.prompt_len + args.output_len / 2
    kv_layer_bytes = (
        concurrency * mean_context * 2 * cfg.num_key_value_heads * cfg.head_dim * kv_element
    )
    looped, once, looped_layers, once_layers = model.streamed_bytes()
    pass_bytes = looped + kv_layer_bytes * looped_layers
    token_bytes = once + kv_layer_bytes * once_layers
    seconds_per_token = (mean_loops * pass_bytes + token_bytes) / bandwidth
    return {
        "bandwidth_gb_s": bandwidth / 1e9,
        "bytes_per_pass": pass_bytes,
        "bytes_once_per_token": token_bytes,
        "decode_tokens_per_s_bound": concurrency / seconds_per_token,
    }


def environment(device: torch.device) -> dict[str, Any]:
    import torch

    info = {"torch": torch.__version__, "python": platform.python_version()}
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
        try:
            import triton

            info["triton"] = triton.__version__
        except ImportError:
            info["triton"] = None
    else:
        info["cpu"] = platform.processor() or platform.machine()
    return info
