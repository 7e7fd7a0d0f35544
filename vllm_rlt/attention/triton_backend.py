"""CUDA ops backed by Triton kernels: fused norms, RoPE fused with the KV write, and paged
attention that resolves each row's plane and block table inside the kernel."""

from __future__ import annotations

import torch
import triton

from vllm_rlt.attention.metadata import AttentionMetadata
from vllm_rlt.kernels.triton_kernels import (
    _add_rms_norm2_kernel,
    _paged_attention_kernel,
    _prefill_attention_kernel,
    _rms_norm_kernel,
    _rope_write_kernel,
    _silu_mul_kernel,
)
from vllm_rlt.layers.rotary import RotaryEmbedding

# Decode attention launch shape (keys per tile, pipeline stages, warps), chosen with
# benchmarks/tune_attention.py on an H200 at Ouro-1.4B head sizes: 128-key tiles without
# software pipelining won everywhere; few rows want 4 warps, many rows 2.
DECODE_BLOCK_N, DECODE_STAGES = 128, 1
FEW_ROWS, FEW_ROWS_WARPS, MANY_ROWS_WARPS = 16, 4, 2


class TritonOps:
    """Graph-safe: no host reads, shapes depend only on the number of rows."""

    needs_segments = False

    def prefill_tile_rows(self, dtype: torch.dtype) -> int:
        """Query rows per prefill tile; float32 tiles are smaller (exact dots need more
        registers)."""
        return 16 if dtype == torch.float32 else 32

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        rows, n = x.shape
        out = torch.empty_like(x)
        if rows:
            _rms_norm_kernel[(rows,)](
                x, weight, out, x.stride(0), n, n, eps, BLOCK=triton.next_power_of_2(n)
            )
        return out

    def add_rms_norm2(
        self, x: torch.Tensor, branch: torch.Tensor, w_branch, w_next, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        rows, n = x.shape
        x_out, normed = torch.empty_like(x), torch.empty_like(x)
        if rows:
            _add_rms_norm2_kernel[(rows,)](
                x,
                branch,
                w_next if w_branch is None else w_branch,
                w_next,
                x_out,
                normed,
                x.stride(0),
                branch.stride(0),
                n,
                eps,
                BLOCK=triton.next_power_of_2(n),
                NORM_BRANCH=w_branch is not None,
            )
        return x_out, normed

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        rows, double = gate_up.shape
        inter = double // 2
        out = gate_up.new_empty(rows, inter)
        block = 1024
        if rows:
            _silu_mul_kernel[(rows, triton.cdiv(inter, block))](
                gate_up, out, gate_up.stride(0), inter, BLOCK=block
            )
        return out

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
    ) -> torch.Tensor:
        rows = qkv.shape[0]
        head_dim = k_cache.shape[-1]
        q = qkv.new_empty(rows, num_heads, head_dim)
        out = torch.empty_like(q)
        if rows == 0:
            return out.reshape(rows, -1)
        _rope_write_kernel[(rows, num_heads + num_kv_heads)](
            qkv,
            q,
            k_cache,
            v_cache,
            meta.positions,
            rotary.cos,
            rotary.sin,
            meta.row_entry,
            meta.write_lo,
            meta.write_hi,
            qkv.stride(0),
            meta.slots_per_plane,
            NUM_HEADS=num_heads,
            NUM_KV_HEADS=num_kv_heads,
            HEAD_DIM=head_dim,
            PLANES=meta.planes,
        )
        tiles = meta.prefill_tiles
        row_kernel_rows = rows if tiles is None else meta.num_decode
        if tiles is not None and tiles.num_tiles:
            exact = q.dtype == torch.float32
            _prefill_attention_kernel[(tiles.num_tiles, num_heads)](
                q,
                k_cache,
                v_cache,
                out,
                tiles.row,
                tiles.length,
                tiles.position,
                tiles.slot,
                tiles.plane,
                meta.block_table,
                meta.block_table.stride(0),
                meta.slots_per_plane,
                meta.block_size,
                scale,
                NUM_HEADS=num_heads,
                NUM_KV_HEADS=num_kv_heads,
                HEAD_DIM=head_dim,
                BLOCK_M=self.prefill_tile_rows(q.dtype),
                BLOCK_N=16 if exact else 32,
                IEEE=exact,
                num_warps=4,
            )
        if row_kernel_rows == 0:
            return out.reshape(rows, -1)
        _paged_attention_kernel[(row_kernel_rows, num_heads)](
            q,
            k_cache,
            v_cache,
            out,
            meta.positions,
            meta.row_slots,
            meta.read_plane,
            meta.block_table,
            meta.block_table.stride(0),
            meta.slots_per_plane,
            meta.block_size,
            scale,
            NUM_HEADS=num_heads,
            NUM_KV_HEADS=num_kv_heads,
            HEAD_DIM=head_dim,
            BLOCK_N=DECODE_BLOCK_N,
            STAGES=DECODE_STAGES,
            num_warps=FEW_ROWS_WARPS if row_kernel_rows <= FEW_ROWS else MANY_ROWS_WARPS,
        )
        return out.reshape(rows, -1)
