"""The ops contract: every op a model's loop calls, which each backend implements.

A model (models/ouro.py) runs one loop of its layer stack through these ops only, so a
backend changes how a pass computes, never what: `TorchOps` (ops/torch_ops.py) is the
reference that runs anywhere, `TritonOps` (ops/triton_ops.py) the CUDA backend of fused
Triton kernels, which matches it up to reduction order.

Shapes: `rows` packed rows of one pass (any mix of requests, loops and planes), `hidden` the
residual width, `heads` / `kv_heads` the query and KV heads of this rank, `head_dim` a head's
width; a weight is [N outputs, K inputs], a tensor or an Fp8Weight (layers/fp8.py).

A new backend (for example hand-written CUDA kernels) is a class with these members and
a loader registered in ops/registry.py (`register_backend(name, is_available, load, fits,
takes_fp8)`, in the order "auto" tries them: the first available wins). Its kernels belong in
kernels/, one module a family, imported only by its ops module, which the loader imports
on first use: the package must import on machines without the backend's toolchain. Its
passes run under CUDA graphs when `needs_segments` is False: it then reads nothing on the
host, launches shapes that depend only on the row count, takes prompt rows in tiles of
`prefill_tile_rows` (`meta.prefill_tiles`) and, in a captured pass, the row and tile counts
from the device (`meta.device_counts`; see ops/metadata.py).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from vllm_rlt.layers.fp8 import Fp8Weight
from vllm_rlt.layers.rotary import RotaryEmbedding
from vllm_rlt.layers.sampler import SamplingTensors, TokenBan
from vllm_rlt.ops.metadata import AttentionMetadata

Weight = torch.Tensor | Fp8Weight


@runtime_checkable
class LoopOps(Protocol):
    """The fused ops of one loop over packed rows."""

    # True: attention reads `meta.segments` (rows grouped by shared context, built on the
    # host, so no CUDA graph); False: the kernels resolve planes and blocks themselves.
    needs_segments: bool

    def prefill_tile_rows(self, dtype: torch.dtype) -> int:
        """Query rows per tile of prompt attention (0: prompt rows attend through segments)."""
        ...

    def rms_norm(
        self,
        x: torch.Tensor,  # [rows, hidden]
        weight: torch.Tensor,  # [hidden]
        eps: float,
        next_weight: Weight | None = None,  # the weight the result is multiplied by next
    ) -> torch.Tensor:
        """RMSNorm(x) * weight; [rows, hidden]. With `next_weight` a backend may return it in
        the form its own products take for that weight (as float8 rows for FP8 tensor
        cores): a value only for `linear`, `linear_silu_mul` or `linear_add_rms_norm2` with
        that weight."""
        ...

    def add_rms_norm2(
        self,
        x: torch.Tensor,  # [rows, hidden] residual stream
        branch: torch.Tensor,  # [rows, hidden]
        w_branch: torch.Tensor | None,  # [hidden] norm of the branch; None: added as it is
        w_next: torch.Tensor,  # [hidden]
        eps: float,
        next_weight: Weight | None = None,  # as rms_norm's, for the second result
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + RMSNorm(branch) * w_branch, RMSNorm of that sum * w_next), both [rows, hidden]."""
        ...

    def linear_add_rms_norm2(
        self,
        x: torch.Tensor,  # [rows, hidden]
        inp: torch.Tensor,  # [rows, K]
        weight: Weight,  # [hidden, K]
        w_branch: torch.Tensor | None,
        w_next: torch.Tensor,
        eps: float,
        live: torch.Tensor | None = None,  # [rows] bool, as `linear` takes it
        next_weight: Weight | None = None,  # as rms_norm's, for the second result
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """add_rms_norm2(x, inp @ weight.T, ...) as one op, so a backend may fuse the two;
        rows not `live` may come back as anything finite."""
        ...

    def linear(
        self,
        x: torch.Tensor,  # [rows, K]
        weight: Weight,  # [N, K]
        live: torch.Tensor | None = None,  # [rows] bool: rows whose output is used
    ) -> torch.Tensor:
        """x @ weight.T, [rows, N]; rows not `live` may come back as zeros."""
        ...

    def linear_silu_mul(
        self,
        x: torch.Tensor,  # [rows, K]
        gate_up: Weight,  # [2 * inter, K], rows gate_0, up_0, gate_1, up_1, ...
        next_weight: Weight | None = None,  # as rms_norm's
    ) -> torch.Tensor:
        """SiLU(gate) * up of x @ gate_up.T; [rows, inter]."""
        ...

    def token_stats(
        self,
        logits: torch.Tensor,  # [rows, vocab] float32, or the LM head's 16-bit floats
        tokens: torch.Tensor | None,  # [rows] int64; None: each row's argmax (greedy)
        ban: TokenBan | None = None,  # tokens that count as -inf
        live: torch.Tensor | None = None,  # [rows] bool: rows whose results are used
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(the tokens, their logprobs [rows] float32, their ranks [rows] int64: 1 + how many
        other tokens are at least as likely), of the logits widened to float32 with `ban`
        applied; rows not `live` may come back as zeros."""
        ...

    def sample_plain(
        self,
        logits: torch.Tensor,  # [rows, vocab] float32, or the LM head's 16-bit floats
        temperature: torch.Tensor,  # [rows] float32; 0 = greedy
        seeds: torch.Tensor,  # [rows] int64
        counters: torch.Tensor,  # [rows] int64: the index of the token being sampled
        ban: TokenBan | None = None,  # tokens that count as -inf
    ) -> torch.Tensor:
        """Tokens [rows] int64 drawn as `layers.sampler.sample` draws them for rows that
        filter nothing (the argmax of logits / temperature plus the seeded Gumbel noise),
        with no sort; greedy rows take their first maximum. The logits are widened to
        float32 and `ban` applied first."""
        ...

    def sample_filtered(
        self,
        logits: torch.Tensor,  # [rows, vocab] float32
        settings: SamplingTensors,  # [rows] each
        counters: torch.Tensor,  # [rows] int64: the index of the token being sampled
    ) -> torch.Tensor:
        """Tokens [rows] int64 drawn as `layers.sampler.sample` draws them: each row's
        logits / temperature filtered by top-n-sigma, top-k, top-p and min-p, then the
        seeded Gumbel-max draw among the kept tokens; greedy rows take their first
        maximum."""
        ...

    def attention(
        self,
        qkv: torch.Tensor,  # [rows, (heads + 2 * kv_heads) * head_dim]
        num_heads: int,
        num_kv_heads: int,
        k_cache: torch.Tensor,  # [planes * slots_per_plane, kv_heads, head_dim]
        v_cache: torch.Tensor,  # as k_cache
        meta: AttentionMetadata,
        rotary: RotaryEmbedding,
        scale: float,
        kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,  # [kv_heads] each
    ) -> torch.Tensor:
        """RoPE, write each row's K/V into the planes it owns, attend; [rows, heads * head_dim].
        kv_scales apply to a float8 cache only (it holds K / k_scale and V / v_scale)."""
        ...
