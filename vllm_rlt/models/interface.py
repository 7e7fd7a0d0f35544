"""What the engine and the worker use of a model: its config's sizes (LoopedConfig) and the
stages of a looped pass, plus the sharding and quantization they ask of it (LoopedModel).

A model family (models/registry.py) implements both; nothing outside models/ reaches into
a model's layers, so a family may lay out and fuse its weights as it likes.
"""

from __future__ import annotations

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


@runtime_checkable
class RankGroup(Protocol):
    """The model's side of its tensor-parallel group (parallel/tensor_parallel.py)."""

    rank: int
    world: int

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's `tensor`, in place."""
        ...


@runtime_checkable
class LoopedModel(Protocol):
    """A model run as prelude, `num_loops` loops of core, and gate / coda on the state a
    loop leaves; `rows` below are a pass's packed rows."""

    config: LoopedConfig
    dtype: torch.dtype
    device: torch.device
    quantization: str | None  # how the layer projections are stored ("fp8"; None: dtype)
    tensor_parallel: RankGroup | None  # set by `shard`

    def prelude(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Embed token ids [rows] into the residual stream [rows, hidden]."""
        ...

    def core(
        self,
        hidden: torch.Tensor,  # [rows, hidden]
        meta: AttentionMetadata,
        k_caches: list[torch.Tensor],  # per layer [planes * slots_per_plane, kv_heads, head_dim]
        v_caches: list[torch.Tensor],
        ops: LoopOps,
    ) -> torch.Tensor:
        """One loop of the layer stack over rows at any mix of loops; [rows, hidden]."""
        ...

    def gate(self, hidden: torch.Tensor) -> torch.Tensor:
        """Exit-gate logits [rows] in float32 from the end-of-loop state [rows, hidden]."""
        ...

    def coda(
        self,
        hidden: torch.Tensor,  # [rows, hidden]
        ops: LoopOps | None = None,
        live: torch.Tensor | None = None,  # [rows] bool: rows whose logits are used
    ) -> torch.Tensor:
        """LM-head logits [rows, vocab] in float32 (rows not `live` may be zeros)."""
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
