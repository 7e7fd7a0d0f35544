"""What the engine and the worker use of a model: its config's sizes (LoopedConfig) and the
stages of a looped pass, plus the sharding and quantization they ask of it (LoopedModel).

A model family (models/registry.py) implements both; nothing outside models/ reaches into
a model's layers, so a family may lay out and fuse its weights as it likes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from vllm_rlt.layers.fp8 import Fp8Weight
from vllm_rlt.ops.base import LoopOps
from vllm_rlt.ops.metadata import AttentionMetadata


@runtime_checkable
class LoopedConfig(Protocol):
    """The sizes of a looped model (a family's config.json dataclass), read only."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    num_loops: int  # loops of the shared layer stack at full depth
    exit_threshold: float  # the default exit threshold (1.0: full depth)
    tie_word_embeddings: bool
    eos_token_ids: tuple[int, ...]

    def kv_planes(self, planes: int) -> tuple[int, ...]:
        """Planes of each attention layer's K/V cache, in the order `LoopedModel.step` takes
        the caches, when a looped layer keeps `planes` (a layer that runs once per token
        keeps one)."""
        ...


@runtime_checkable
class RankGroup(Protocol):
    """The model's side of its tensor-parallel group (parallel/tensor_parallel.py)."""

    rank: int
    world: int

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's `tensor`, in place."""
        ...


@dataclass
class StepInputs:
    """What each packed row of a pass brings to one loop (its position is in the
    attention metadata)."""

    tokens: torch.Tensor  # [rows] int64, the token the row computes
    carried: torch.Tensor  # [rows, carried_width], what its previous loop left (loop > 0)
    loops: torch.Tensor  # [rows] int64, the 0-based loop it runs
    seeds: torch.Tensor | None = None  # [rows] int64, its request's seed (see draws_initial_state)
    # [rows] bool: padding rows of a captured pass (their results are dropped, so a model
    # may skip work for them); None: none
    padding: torch.Tensor | None = None


@runtime_checkable
class LoopedModel(Protocol):
    """A model run one loop per pass: `step` takes each row through the once-per-token
    layers before the loop (at its first loop) and the looped layers; once the pass knows
    which rows exit, `readout` runs the layers after the loop for those rows, and `coda`
    turns their readout into logits. `rows` below are a pass's packed rows, at any mix of
    loops."""

    config: LoopedConfig
    dtype: torch.dtype
    device: torch.device
    quantization: str | None  # how the layer projections are stored ("fp8"; None: dtype)
    tensor_parallel: RankGroup | None  # set by `shard`
    # The first loop starts from a state drawn per (request seed, position), so `step`
    # needs `StepInputs.seeds`; otherwise from the embedded token.
    draws_initial_state: bool
    # `readout` runs layers after the loop; otherwise it returns the state itself.
    separate_readout: bool
    # What a row carries from one loop to the next: its state (the first hidden_size
    # columns, which exit policies read), then whatever else the model keeps per row.
    carried_width: int
    exit_policy: str  # the exit policy (config.EXIT_POLICY_CLASSES) of ExitConfig mode "auto"

    def step(
        self,
        rows: StepInputs,
        meta: AttentionMetadata,
        k_caches: list[torch.Tensor],  # per cache (config.kv_planes) [planes * slots_per_plane,
        v_caches: list[torch.Tensor],  # kv_heads, head_dim]
        ops: LoopOps,
    ) -> torch.Tensor:
        """One loop of every row: what it carries to its next loop [rows, carried_width]."""
        ...

    def readout(
        self,
        carried: torch.Tensor,  # [rows, carried_width] what `step` returned
        live: torch.Tensor,  # [rows] bool: rows that exit this pass (or whose logits are read)
        meta: AttentionMetadata,
        k_caches: list[torch.Tensor],
        v_caches: list[torch.Tensor],
        ops: LoopOps,
    ) -> torch.Tensor:
        """What `coda` reads of each `live` row if it exits now [rows, hidden]; other rows
        may hold anything and write no K/V (the layers after the loop write a token's K/V
        once, at the loop it exits)."""
        ...

    def coda(
        self,
        readout: torch.Tensor,  # [rows, hidden]
        ops: LoopOps | None = None,
        live: torch.Tensor | None = None,  # [rows] bool: rows whose logits are used
        upcast: bool = True,
    ) -> torch.Tensor:
        """LM-head logits [rows, vocab] in float32 (rows not `live` may be zeros); with
        `upcast` False, in the head's own dtype (what the one-read sampling kernels take:
        widening bfloat16 is exact, so only the float32 copy is saved)."""
        ...

    def streamed_bytes(self) -> tuple[int, int, int, int]:
        """What a token must stream from memory at the least (what a roofline counts):
        (weight bytes per loop, weight bytes once per token, attention layers read per
        loop, attention layers read once per token)."""
        ...

    def checkpoint_views(self) -> dict[str, torch.Tensor | Fp8Weight]:
        """Every checkpoint tensor name and the view of the model's storage that holds it,
        for weight updates in place."""
        ...

    def shard(self, group: RankGroup) -> None:
        """Keep this rank's share of every layer and all-reduce the split products; the
        config then describes this rank's share."""
        ...

    def quantize(self, kind: str | None) -> None:
        """Store the layer projections as `kind` ("fp8"; None: leave them)."""
        ...
