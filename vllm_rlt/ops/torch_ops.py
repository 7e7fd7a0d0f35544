"""Reference ops in plain torch: norms, activation, RoPE + KV write and gathered attention."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from vllm_rlt.layers.fp8 import Fp8Weight, applied_kv_scales, fp8_linear_reference, is_float8
from vllm_rlt.layers.norm import rms_norm
from vllm_rlt.layers.rotary import RotaryEmbedding
from vllm_rlt.layers.sampler import (
    SamplingTensors,
    TokenBan,
    sample,
    sample_plain,
    token_logprobs,
)
from vllm_rlt.ops.base import Weight
from vllm_rlt.ops.metadata import AttentionMetadata


class TorchOps:
    """LoopOps (ops/base.py) in plain torch: runs anywhere, the correctness reference for
    every other backend."""

    needs_segments = True

    def prefill_tile_rows(self, dtype: torch.dtype) -> int:
        return 0  # no tiled prefill kernel: prompt rows attend through segments

    def rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, next_weight: Weight | None = None
    ) -> torch.Tensor:
        return rms_norm(x, weight, eps)

    def add_rms_norm2(
        self,
        x: torch.Tensor,
        branch: torch.Tensor,
        w_branch,
        w_next,
        eps: float,
        next_weight: Weight | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x + RMSNorm(branch) (x + branch when w_branch is None), and RMSNorm of that sum
        with the next weight."""
        x = x + (branch if w_branch is None else rms_norm(branch, w_branch, eps))
        return x, rms_norm(x, w_next, eps)

    def linear_add_rms_norm2(
        self,
        x: torch.Tensor,
        inp: torch.Tensor,
        weight: Weight,
        w_branch,
        w_next,
        eps: float,
        live: torch.Tensor | None = None,
        next_weight: Weight | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """add_rms_norm2 of x and the projected branch inp @ weight.T: one op, so that a
        backend may fuse the projection's reduction into the norm."""
        return self.add_rms_norm2(x, self.linear(inp, weight, live), w_branch, w_next, eps)

    def token_stats(
        self,
        logits: torch.Tensor,
        tokens: torch.Tensor | None,
        ban: TokenBan | None = None,
        live: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Every row's results, `live` or not."""
        logits = _widened(logits, ban)
        if tokens is None:
            tokens = logits.argmax(dim=-1)
        chosen, ranks, _, _ = token_logprobs(logits, tokens, 0)
        return tokens, chosen, ranks

    def sample_plain(
        self,
        logits: torch.Tensor,
        temperature: torch.Tensor,
        seeds: torch.Tensor,
        counters: torch.Tensor,
        ban: TokenBan | None = None,
    ) -> torch.Tensor:
        return sample_plain(_widened(logits, ban), temperature, seeds, counters)

    def sample_filtered(
        self, logits: torch.Tensor, settings: SamplingTensors, counters: torch.Tensor
    ) -> torch.Tensor:
        """The filters found on the sorted distribution."""
        return sample(logits, settings, counters)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """SiLU(gate) * up from interleaved columns gate_0, up_0, gate_1, up_1, ..."""
        gate, up = gate_up.unflatten(-1, (-1, 2)).unbind(-1)
        return F.silu(gate) * up

    def linear(
        self, x: torch.Tensor, weight: Weight, live: torch.Tensor | None = None
    ) -> torch.Tensor:
        """x @ weight.T; rows not `live` come back as zeros, as a backend that skips idle
        rows may return them, so what reads them is tested on every device."""
        if isinstance(weight, Fp8Weight):
            out = fp8_linear_reference(x, weight)
        else:
            out = F.linear(x, weight)
        return out if live is None else torch.where(live.unsqueeze(1), out, 0.0)

    def linear_silu_mul(
        self, x: torch.Tensor, gate_up: Weight, next_weight: Weight | None = None
    ) -> torch.Tensor:
        """silu_mul(x @ gate_up.T) for the interleaved gate/up weight."""
        return self.silu_mul(self.linear(x, gate_up))

    def attention(
        self,
        qkv: torch.Tensor,  # [rows, (heads + 2 * kv_heads) * head_dim]
        num_heads: int,
        num_kv_heads: int,
        k_cache: torch.Tensor,  # [planes * slots_per_plane, kv_heads, head_dim]
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        rotary: RotaryEmbedding,
        scale: float,
        kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """RoPE, write K/V into the planes each row owns, attend; returns [rows, heads * dim].
        kv_scales ([kv_heads] each) apply to a float8 cache only: it holds K / k_scale and
        V / v_scale, and reads multiply them back."""
        rows = qkv.shape[0]
        head_dim = k_cache.shape[-1]
        q, k, v = qkv.split(
            [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1
        )
        q = rotary.apply(q.reshape(rows, num_heads, head_dim), meta.positions)
        k = rotary.apply(k.reshape(rows, num_kv_heads, head_dim), meta.positions)
        v = v.reshape(rows, num_kv_heads, head_dim)
        write = meta.write_index().reshape(-1)  # [planes, rows], plane-major like the repeat
        k_scale, v_scale = applied_kv_scales(kv_scales, k_cache) or (None, None)
        _write(k_cache, write, k.repeat(meta.planes, 1, 1), k_scale)
        _write(v_cache, write, v.repeat(meta.planes, 1, 1), v_scale)
        seg_k = _widen(k_cache, meta.segments.kv_index, q.dtype, k_scale)
        seg_v = _widen(v_cache, meta.segments.kv_index, q.dtype, v_scale)
        return _segment_attention(q, seg_k, seg_v, meta, scale).reshape(rows, -1)


def _write(
    cache: torch.Tensor, index: torch.Tensor, values: torch.Tensor, scale: torch.Tensor | None
) -> None:
    """cache[index] = values (divided by the per-head `scale` in float32), rounded to the
    cache's dtype (a float8 cache is written through its bytes: torch has no float8
    index_copy_ on every device)."""
    if scale is not None:
        values = values.float() / scale[:, None]
    values = values.to(cache.dtype)
    if is_float8(cache):
        cache, values = cache.view(torch.uint8), values.view(torch.uint8)
    cache.index_copy_(0, index, values)


def _widen(cache: torch.Tensor, index: torch.Tensor, dtype, scale: torch.Tensor | None):
    """cache[index] in `dtype`, multiplied back by the per-head `scale` in float32."""
    values = cache[index]
    if scale is None:
        return values.to(dtype)
    return (values.float() * scale[:, None]).to(dtype)


def _segment_attention(q, seg_k, seg_v, meta: AttentionMetadata, scale: float):
    """Causal attention of every row over its segment's keys and values (seg_k, seg_v:
    [segs, max_kv, kv_heads, dim], as `_widen` gives them); [rows, heads, dim]."""
    seg = meta.segments
    assert seg is not None
    rows, heads, head_dim = q.shape
    kv_heads = seg_k.shape[2]
    q_padded = torch.cat([q, q.new_zeros(1, heads, head_dim)])  # [rows + 1, heads, dim]
    seg_q = q_padded[seg.rows].transpose(1, 2)  # [segs, heads, max_q, dim]
    seg_k, seg_v = seg_k.transpose(1, 2), seg_v.transpose(1, 2)  # [segs, kv_heads, max_kv, dim]
    if kv_heads != heads:
        seg_k = seg_k.repeat_interleave(heads // kv_heads, dim=1)
        seg_v = seg_v.repeat_interleave(heads // kv_heads, dim=1)
    mask = seg.kv_pos.unsqueeze(1) <= seg.q_pos.unsqueeze(2)  # [segs, max_q, max_kv]
    out = F.scaled_dot_product_attention(
        seg_q, seg_k, seg_v, attn_mask=mask.unsqueeze(1), scale=scale
    )  # [segs, heads, max_q, dim]
    result = q.new_empty(rows + 1, heads, head_dim)
    result.index_copy_(0, seg.rows.reshape(-1), out.transpose(1, 2).reshape(-1, heads, head_dim))
    return result[:rows]


def _widened(logits: torch.Tensor, ban: TokenBan | None) -> torch.Tensor:
    """The logits in float32 with `ban` applied (what the one-read kernels read them as)."""
    logits = logits.float()
    return logits if ban is None else ban.apply(logits)
