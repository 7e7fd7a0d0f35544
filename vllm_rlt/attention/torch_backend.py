"""Reference paged attention in plain torch: write K/V per plane, gather each segment's keys."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from vllm_rlt.attention.metadata import AttentionMetadata


def paged_attention(
    q: torch.Tensor,  # [rows, heads, head_dim], RoPE applied
    k: torch.Tensor,  # [rows, kv_heads, head_dim], RoPE applied
    v: torch.Tensor,  # [rows, kv_heads, head_dim]
    k_cache: torch.Tensor,  # [planes * slots_per_plane, kv_heads, head_dim]
    v_cache: torch.Tensor,  # [planes * slots_per_plane, kv_heads, head_dim]
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Causal attention of every row over its segment's cached keys; returns [rows, heads, dim]."""
    rows, heads, head_dim = q.shape
    kv_heads = k.shape[1]
    planes = meta.write_index.shape[0]
    flat_write = meta.write_index.reshape(-1)  # [planes * rows], plane-major like the repeat
    k_cache.index_copy_(0, flat_write, k.repeat(planes, 1, 1))
    v_cache.index_copy_(0, flat_write, v.repeat(planes, 1, 1))

    q_padded = torch.cat([q, q.new_zeros(1, heads, head_dim)])  # [rows + 1, heads, dim]
    seg_q = q_padded[meta.seg_rows].transpose(1, 2)  # [segs, heads, max_q, dim]
    seg_k = k_cache[meta.seg_kv_index].transpose(1, 2)  # [segs, kv_heads, max_kv, dim]
    seg_v = v_cache[meta.seg_kv_index].transpose(1, 2)
    if kv_heads != heads:
        seg_k = seg_k.repeat_interleave(heads // kv_heads, dim=1)
        seg_v = seg_v.repeat_interleave(heads // kv_heads, dim=1)
    mask = meta.seg_kv_pos.unsqueeze(1) <= meta.seg_q_pos.unsqueeze(2)  # [segs, max_q, max_kv]
    out = F.scaled_dot_product_attention(
        seg_q, seg_k, seg_v, attn_mask=mask.unsqueeze(1), scale=scale
    )  # [segs, heads, max_q, dim]
    result = q.new_empty(rows + 1, heads, head_dim)
    result.index_copy_(
        0, meta.seg_rows.reshape(-1), out.transpose(1, 2).reshape(-1, heads, head_dim)
    )
    return result[:rows]
