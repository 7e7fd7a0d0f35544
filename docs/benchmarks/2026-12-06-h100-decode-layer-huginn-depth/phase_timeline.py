"""Per-phase timeline of the one-launch layer, from the %globaltimer stamps that
copy_ring_and_phase_stamps.patch adds (thread 0 of every block, at the end of each phase,
into the module's `dl_trace`). Run from the repository root with the patch applied;
DL_MODE picks the product pipeline (0: registers, 1: copy ring of weights and x, 2: copy
ring of weights)."""

import ctypes
import math
import statistics

import torch

from benchmarks.probe_decode_layer import (
    EPS,
    HEADS,
    KV_HEADS,
    LAYERS,
    build_cache,
    build_weights,
    fused_layer,
)
from vllm_rlt.kernels import decode_layer
from vllm_rlt.kernels.cuda_driver import _call
from vllm_rlt.layers.rotary import RotaryEmbedding
from vllm_rlt.ops.triton_ops import TritonOps

PHASES = ["qkv", "attn", "o+norm", "gate_up", "down+norm"]


def stamps(module, blocks: int) -> list[list[int]]:
    """Each block's six stamps (start, then the end of each phase) of the last launch."""
    pointer, size = ctypes.c_uint64(), ctypes.c_size_t()
    name = b"dl_trace"
    _call("cuModuleGetGlobal_v2", ctypes.byref(pointer), ctypes.byref(size), module._handle, name)
    host = (ctypes.c_uint64 * (blocks * 8))()
    _call("cuMemcpyDtoH_v2", host, pointer, ctypes.c_size_t(blocks * 8 * 8))
    return [[host[b * 8 + i] for i in range(6)] for b in range(blocks)]


def main() -> None:
    ops = TritonOps()
    rotary = RotaryEmbedding(128, 10000.0, 81, torch.bfloat16, "cuda")
    blocks = torch.cuda.get_device_properties(0).multi_processor_count
    for kind in ("bf16", "fp8"):
        layers = [build_weights(kind, seed) for seed in range(LAYERS)]
        for rows in (1, 8, 16):
            caches = [build_cache(rows, [80] * rows, KV_HEADS, s) for s in range(LAYERS)]
            x = torch.randn(rows, 2048, device="cuda").to(torch.bfloat16)
            a = ops.rms_norm(x, layers[0].mlp_norm, EPS)
            module = decode_layer._module(x.device)
            ends: dict[str, list[float]] = {phase: [] for phase in PHASES}
            spread, total = [], []
            for _ in range(3):
                for weights, (k, v, meta) in zip(layers, caches, strict=True):
                    scale = 1 / math.sqrt(128)
                    fused_layer(
                        ops, x, a, weights, weights.mlp_norm, k, v, meta, rotary, HEADS, scale
                    )
                    torch.cuda.synchronize()
                    t = stamps(module, blocks)
                    t0 = min(block[0] for block in t)
                    spread.append((max(block[0] for block in t) - t0) / 1e3)
                    for i, phase in enumerate(PHASES):
                        ends[phase].append((max(block[i + 1] for block in t) - t0) / 1e3)
                    total.append((max(block[5] for block in t) - t0) / 1e3)
            previous, parts = 0.0, []
            for phase in PHASES:
                end = statistics.median(ends[phase])
                parts.append(f"{phase} {end - previous:5.1f}")
                previous = end
            print(
                f"{kind} rows {rows:2d}: total {statistics.median(total):5.1f} us | block start "
                f"spread {statistics.median(spread):4.1f} | " + " | ".join(parts),
                flush=True,
            )


if __name__ == "__main__":
    main()
