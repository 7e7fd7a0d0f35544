"""What an RL trainer does to a rollout engine between uses, as vLLM offers it: new weights
copied in place (`load_weights`), and sleep mode, which gives the device memory of the KV
pool and the weights back while the trainer needs the GPU.

Level 1 frees the KV pool and moves the weights to host memory; level 2 frees both, and new
weights come with `load_weights`. The tensors stay the same objects: only their storage is
released and later allocated again, so every view of them (fused q/k/v rows, tied heads)
and every kernel argument stays valid. CUDA graphs hold device addresses, so they are
dropped before the memory goes and captured again on wake-up.
"""

from __future__ import annotations

import gc
from collections.abc import Iterable, Mapping

import torch

from vllm_rlt.config import require
from vllm_rlt.layers.fp8 import Fp8Weight
from vllm_rlt.worker.model_runner import ModelRunner

SLEEP_LEVELS = (1, 2)


def weight_tensors(model) -> list[torch.Tensor]:
    """One tensor per storage holding a checkpoint weight (views and ties collapsed)."""
    seen: dict[int, torch.Tensor] = {}
    for view in model.checkpoint_views().values():
        for tensor in view.tensors() if isinstance(view, Fp8Weight) else (view,):
            base = tensor if tensor._base is None else tensor._base
            seen.setdefault(base.untyped_storage().data_ptr(), base)
    return list(seen.values())


def copy_weights_in_place(
    model,
    weights: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor],
    every_tensor: bool = False,
) -> None:
    """Copy (checkpoint name, tensor) pairs into the model's own tensors, so the KV pool,
    CUDA graphs and kernels stay valid; every pair is checked first (ParamError naming a
    wrong name or shape; nothing is copied then). `every_tensor`: the model holds no
    weights (after sleep level 2), so all of them must come. A tied model ignores
    lm_head.weight, as vLLM does; an fp8 projection quantizes what it is given."""
    views = model.checkpoint_views()
    tied = model.config.tie_word_embeddings
    if isinstance(weights, Mapping):
        weights = weights.items()
    skipped = ("rotary_emb.inv_freq", *(["lm_head.weight"] if tied else []))
    pairs = [(name, t) for name, t in weights if not name.endswith(skipped)]
    for name, tensor in pairs:
        require(name in views, f"load_weights: {name!r} is no tensor of this model", "weights")
        require(
            isinstance(tensor, torch.Tensor) and tensor.is_floating_point(),
            f"load_weights: {name} must be a floating-point tensor (it is cast to the model's "
            f"dtype), got {getattr(tensor, 'dtype', type(tensor).__name__)}",
            "weights",
        )
        require(
            tuple(tensor.shape) == tuple(views[name].shape),
            f"load_weights: {name} has shape {tuple(tensor.shape)}, the model's is "
            f"{tuple(views[name].shape)}",
            "weights",
        )
    require(
        not every_tensor or {name for name, _ in pairs} == set(views),
        "after sleep(level=2) load_weights needs every tensor of the checkpoint",
        "weights",
    )
    with torch.no_grad():
        for name, tensor in pairs:
            views[name].copy_(tensor)


# What a sleeping engine gives back and `wake_up(tags)` takes back, by name.
WAKE_TAGS = ("weights", "kv_cache")


class EngineSleep:
    """The memory an engine gave back, and how to take it again, in parts: vLLM's wake-up
    tags "weights" and "kv_cache" (an RL trainer wakes the weights, loads new ones, then the
    KV pool)."""

    def __init__(self, runner: ModelRunner, level: int) -> None:
        self.level = level
        self.parts = {"kv_cache": [*runner.k_caches, *runner.v_caches]}
        self.parts["weights"] = weight_tensors(runner.model)
        every = [t for tensors in self.parts.values() for t in tensors]
        require(
            all(t.untyped_storage().resizable() for t in every),
            "this model's weights live in storage that cannot be released (file-backed)",
            "level",
        )
        self.nbytes = {id(t): t.untyped_storage().nbytes() for t in every}
        # Level 1 keeps the weights on the host; level 2 drops them.
        self.saved = [w.to("cpu", copy=True) for w in self.parts["weights"]] if level == 1 else None
        self.asleep = set(WAKE_TAGS)
        runner.drop_graphs()  # they read the memory about to go
        # A served process froze its start-up heap (process_setup), and a collection
        # reaches only unfrozen objects: thawed here, frozen again once awake. (Some
        # interpreters keep objects of their own frozen from the start: the count left
        # after a thaw and a collection is what nobody froze.)
        frozen = gc.get_freeze_count()
        gc.unfreeze()
        gc.collect()
        self.frozen = frozen > gc.get_freeze_count()
        for tensor in every:
            tensor.untyped_storage().resize_(0)
        if runner.model.device.type == "cuda":
            torch.cuda.empty_cache()

    def wake(self, tag: str) -> None:
        """Allocate one part again: the KV pool zeroed (masked keys must hold finite values),
        the weights as they were (level 1) or zeroed until `load_weights` (level 2)."""
        if tag not in self.asleep:
            return
        for tensor in self.parts[tag]:
            tensor.untyped_storage().resize_(self.nbytes[id(tensor)])
            if tag == "kv_cache" or self.level == 2:
                tensor.zero_()
        if tag == "weights" and self.saved is not None:
            with torch.no_grad():
                for tensor, saved in zip(self.parts["weights"], self.saved, strict=True):
                    tensor.copy_(saved)
            self.saved = None
        self.asleep.discard(tag)


class TrainerHooks:
    """An engine core's side of the hooks: whether it sleeps (and what it gave back), and
    whether it has weights (none after a level-2 sleep until `load_weights`). Each hook
    needs an idle engine; the core checks that and mirrors the call to tensor-parallel
    ranks (engine/engine_core.py)."""

    def __init__(self, runner: ModelRunner, cuda_graphs: bool, max_num_batched_tokens: int) -> None:
        self.runner = runner
        self.cuda_graphs, self.max_num_batched_tokens = cuda_graphs, max_num_batched_tokens
        self.sleeping: EngineSleep | None = None
        self.weights_unset = False

    def check_serving(self) -> None:
        """A request may come: the engine is awake and has weights."""
        asleep = sorted(self.sleeping.asleep) if self.sleeping is not None else []
        require(
            self.sleeping is None,
            "the engine is sleeping: wake it up first"
            + (f" (still asleep: {asleep[0]})" if len(asleep) == 1 else ""),
            "request",
        )
        require(
            not self.weights_unset,
            "the engine slept at level 2 and has no weights: load them with load_weights",
            "request",
        )

    def load_weights(self, weights) -> None:
        require(
            self.sleeping is None or "weights" not in self.sleeping.asleep,
            "the engine's weights are asleep: wake them up first (wake_up(tags=['weights']))",
            "weights",
        )
        copy_weights_in_place(self.runner.model, weights, every_tensor=self.weights_unset)
        self.weights_unset = False

    def sleep(self, level: int, tensor_parallel: bool) -> None:
        require(level in SLEEP_LEVELS, f"level must be 1 or 2, got {level!r}", "level")
        require(
            level == 1 or not tensor_parallel,
            "sleep(level=2) with tensor_parallel_size > 1 is not supported (load_weights is "
            "not, to bring the weights back)",
            "level",
        )
        if self.sleeping is not None:  # as vLLM: a no-op, like wake_up when awake
            return
        self.sleeping = EngineSleep(self.runner, level)
        self.weights_unset = self.weights_unset or level == 2

    def wake_up(self, tags: list[str] | tuple[str, ...] | None = None) -> None:
        """Wake the parts `tags` names (None: all). Once none sleeps, the CUDA graphs are
        captured again and requests may come."""
        tags = WAKE_TAGS if tags is None else (tags,) if isinstance(tags, str) else tuple(tags)
        require(
            bool(tags) and all(tag in WAKE_TAGS for tag in tags),
            f"tags must name some of {list(WAKE_TAGS)}, got {list(tags)!r}",
            "tags",
        )
        if self.sleeping is None:
            return
        for tag in tags:
            self.sleeping.wake(tag)
        if not self.sleeping.asleep:
            # A failure leaves the engine asleep: a retried wake_up sets the device up again.
            self.runner.prepare_device(self.cuda_graphs, self.max_num_batched_tokens)
            if self.sleeping.frozen:
                gc.freeze()
            self.sleeping = None
