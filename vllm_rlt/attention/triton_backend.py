"""CUDA ops backed by Triton kernels: fused norms, RoPE fused with the KV write, and paged
attention that resolves each row's plane and block table inside the kernel."""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton

from vllm_rlt.attention.metadata import AttentionMetadata
from vllm_rlt.kernels.pdl import launch_options, pdl_supported
from vllm_rlt.kernels.skinny_linear import SkinnyConfig, skinny_linear
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

# Programmatic dependent launch where the GPU has it (Hopper and newer).
USE_PDL = True

# Linear layers of passes with at most this many rows use the skinny kernel (cuBLAS above).
SKINNY_MAX_ROWS = 16


def use_skinny(rows: int, weight: torch.Tensor) -> bool:
    """Few rows and a layer at least as wide as it is deep. Narrow, deep layers (the down
    projection, 2048 x 5632) stay on cuBLAS, whose split-K keeps more SMs busy: the skinny
    kernel measured 0.93-0.97x there, and 1.0-1.13x on the others (tune_linear.py, H200)."""
    n, k = weight.shape
    return rows <= SKINNY_MAX_ROWS and n >= k


def skinny_config(n: int, element_size: int) -> SkinnyConfig:
    """Launch shape by output width, from benchmarks/tune_linear.py on an H200 in bf16 at
    Ouro-1.4B shapes (o 2048, qkv 6144, gate_up 11264, LM head 49152 columns); wider
    elements take proportionally shorter K chunks, so a stage holds the same bytes."""
    if n <= 4096:
        block_n, block_k, stages = 16, 256, 4
    elif n <= 8192:
        block_n, block_k, stages = 64, 256, 4
    elif n <= 16384:
        block_n, block_k, stages = 32, 128, 4
    else:
        block_n, block_k, stages = 64, 128, 2
    return SkinnyConfig(block_n, block_k * 2 // element_size, warps=4, stages=stages)


class TritonOps:
    """Graph-safe: no host reads, shapes depend only on the number of rows."""

    needs_segments = False

    def __init__(self) -> None:
        # Every kernel here waits for its predecessor on the device (kernels/pdl.py), so
        # each may be launched before the previous one has finished.
        self.pdl = USE_PDL and pdl_supported()

    def prefill_tile_rows(self, dtype: torch.dtype) -> int:
        """Query rows per prefill tile; float32 tiles are smaller (exact dots need more
        registers)."""
        return 16 if dtype == torch.float32 else 32

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        rows, n = x.shape
        out = torch.empty_like(x)
        if rows:
            _rms_norm_kernel[(rows,)](
                x,
                weight,
                out,
                x.stride(0),
                n,
                n,
                eps,
                BLOCK=triton.next_power_of_2(n),
                **launch_options(self.pdl),
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
                **launch_options(self.pdl),
            )
        return x_out, normed

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        rows, double = gate_up.shape
        inter = double // 2
        out = gate_up.new_empty(rows, inter)
        block = 1024
        if rows:
            _silu_mul_kernel[(rows, triton.cdiv(inter, block))](
                gate_up,
                out,
                gate_up.stride(0),
                inter,
                BLOCK=block,
                **launch_options(self.pdl),
            )  # interleaved columns gate_0, up_0, gate_1, up_1, ...
        return out

    def linear(
        self, x: torch.Tensor, weight: torch.Tensor, live: torch.Tensor | None = None
    ) -> torch.Tensor:
        """x @ weight.T; few rows stream the weight once, and with `live` a pass in which no
        row is live skips the weight (those rows' outputs are zero)."""
        if not use_skinny(x.shape[0], weight):
            return F.linear(x, weight)
        config = skinny_config(weight.shape[0], weight.element_size())
        return skinny_linear(x, weight, config, live=live, pdl=self.pdl)

    def linear_silu_mul(self, x: torch.Tensor, gate_up: torch.Tensor) -> torch.Tensor:
        """silu_mul(x @ gate_up.T); few rows do the SiLU-mul in the GEMM's epilogue."""
        if not use_skinny(x.shape[0], gate_up):
            return self.silu_mul(F.linear(x, gate_up))
        config = skinny_config(gate_up.shape[0], gate_up.element_size())
        return skinny_linear(x, gate_up, config, silu_mul=True, pdl=self.pdl)

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
            **launch_options(self.pdl),
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
                tiles.table,
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
                **launch_options(self.pdl),
            )
        if row_kernel_rows == 0:
            return out.reshape(rows, -1)
        _paged_attention_kernel[(row_kernel_rows, num_heads)](
            q,
            k_cache,
            v_cache,
            out,
            meta.positions,
            meta.row_tables,
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
            **launch_options(self.pdl),
        )
        return out.reshape(rows, -1)
