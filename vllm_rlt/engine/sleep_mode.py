"""vLLM's sleep mode for one engine: give the device memory of the KV pool and the weights
back between uses (an RL trainer needs the GPU while its rollout engine waits).

Level 1 frees the KV pool and moves the weights to host memory; level 2 frees both, and new
weights come with `load_weights`. The tensors stay the same objects: only their storage is
released and later allocated again, so every view of them (fused q/k/v rows, tied heads)
and every kernel argument stays valid. CUDA graphs hold device addresses, so they are
dropped before the memory goes and captured again on wake-up.
"""

from __future__ import annotations

import gc

import torch

from vllm_rlt.engine.device_setup import prepare_device
from vllm_rlt.worker.model_runner import ModelRunner

SLEEP_LEVELS = (1, 2)


def weight_tensors(model) -> list[torch.Tensor]:
    """One tensor per storage holding a checkpoint weight (views and ties collapsed)."""
    seen: dict[int, torch.Tensor] = {}
    for view in model.checkpoint_views().values():
        base = view if view._base is None else view._base
        seen.setdefault(base.untyped_storage().data_ptr(), base)
    return list(seen.values())


class EngineSleep:
    """The memory an engine gave back, and how to take it again."""

    def __init__(self, runner: ModelRunner, level: int) -> None:
        self.level = level
        self.kv = [*runner.k_caches, *runner.v_caches]
        self.weights = weight_tensors(runner.model)
        self.nbytes = [t.untyped_storage().nbytes() for t in self.kv + self.weights]
        # Level 1 keeps the weights on the host; level 2 drops them.
        self.saved = [w.to("cpu", copy=True) for w in self.weights] if level == 1 else None
        runner.graphs = runner.pieces = None  # they read the memory about to go
        gc.collect()
        for tensor in self.kv + self.weights:
            tensor.untyped_storage().resize_(0)
        if runner.model.device.type == "cuda":
            torch.cuda.empty_cache()

    def wake_up(self, runner: ModelRunner, cuda_graphs: bool, max_num_batched_tokens: int) -> None:
        """Allocate again: the KV pool zeroed (masked keys must hold finite values), the
        weights as they were (level 1) or unset until `load_weights` (level 2), the CUDA
        graphs captured anew."""
        for tensor, nbytes in zip(self.kv + self.weights, self.nbytes, strict=True):
            tensor.untyped_storage().resize_(nbytes)
        for tensor in self.kv:
            tensor.zero_()
        if self.saved is not None:
            with torch.no_grad():
                for tensor, saved in zip(self.weights, self.saved, strict=True):
                    tensor.copy_(saved)
        self.saved = None
        prepare_device(runner, runner.ops, cuda_graphs, max_num_batched_tokens)
