"""CUDA ops backed by Triton kernels: fused norms, RoPE fused with the KV write, and paged
attention that resolves each row's plane and block table inside the kernel; each linear
layer runs the kernel and launch shape ops/linear_plans.py picks for its shape and rows."""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton

from vllm_rlt.kernels import paged_attention_cuda as cuda_decode
from vllm_rlt.kernels.decode_attention import (
    _combine_splits_kernel,
    _paged_attention_kernel,
    _rope_attend_kernel,
    attention_shape,
)
from vllm_rlt.kernels.few_row_gemm import few_row_gemm, few_row_gemm_add_norms, takes_few_row
from vllm_rlt.kernels.filter_bound import sample_filtered
from vllm_rlt.kernels.fp8_rows import Fp8Rows, empty_fp8_rows, quantize_rows
from vllm_rlt.kernels.gumbel_sample import gumbel_sample
from vllm_rlt.kernels.norms import _add_rms_norm2_kernel, _rms_norm_kernel, row_warps
from vllm_rlt.kernels.pdl import launch_options, pdl_supported
from vllm_rlt.kernels.prefill_attention import _prefill_attention_kernel
from vllm_rlt.kernels.rope_kv import _rope_write_kernel, _rope_write_rows_kernel
from vllm_rlt.kernels.silu_mul import _silu_mul_kernel
from vllm_rlt.kernels.skinny_linear import skinny_linear, skinny_linear_partials
from vllm_rlt.kernels.strip_gemv import strip_gemv
from vllm_rlt.kernels.token_stats import token_stats
from vllm_rlt.layers.fp8 import FP8_MAX, Fp8Weight, applied_kv_scales, fp8_linear_reference
from vllm_rlt.layers.rotary import RotaryEmbedding
from vllm_rlt.layers.sampler import SamplingTensors, TokenBan
from vllm_rlt.ops.base import Weight
from vllm_rlt.ops.fp8_products import fp8_product, fp8_silu_mul_epilogue
from vllm_rlt.ops.linear_plans import (
    fp8_tensor_cores_take,
    linear_plan,
    takes_fp8_rows,
    takes_strip,
)
from vllm_rlt.ops.metadata import AttentionMetadata

# Decode attention launch shape (keys per tile, pipeline stages, warps), chosen with
# benchmarks/tune_attention.py on an H200 at Ouro-1.4B head sizes: 128-key tiles without
# software pipelining won up to 64 rows; from 256 rows on, one program per row reads K/V
# 13-27% faster with 64-key tiles (docs/benchmarks/2026-12-02-pass-kernels.md). Few rows
# want 4 warps, many rows 2. The bounded grid of a captured prompt pass keeps 128-key tiles:
# with 64-key tiles and 4 warps there, steady load with adaptive depth lost 5-17%.
DECODE_BLOCK_N, DECODE_STAGES = 128, 1
# Decode passes of up to so many rows without speculation lanes write K/V and attend in
# one kernel (`_rope_attend_kernel`): a kernel fewer per layer where launches dominate. A
# variant that carried the new K/V in registers through the key loop lost 4% at 1 row and
# 31% at 256 (docs/benchmarks/2026-12-01-linear-plans.md): its work ahead of the key loop
# is not hidden once programs come in waves. 0: never.
FUSED_DECODE_ROWS = 16
# Split-KV: a decode pass (outside the bounded grid of a captured prompt pass) splits each
# row's key tiles into runs (a power of two, at most MAX_SPLITS) until rows x heads x runs
# reaches this many programs, and a second kernel combines the runs; at one row 16
# programs would otherwise read a long context on 16 of the GPU's SMs. On an H200 at 128
# programs: 2.15x / 1.42x decode at prompt 2048, concurrency 1 / 4, and 0.99-1.00x at
# prompt 64, concurrency 1-8. More programs (512, 2048) gained up to 1.12-1.15x at prompt
# 1024, concurrency 4-16, but lost 4-11% at prompt 64, concurrency 8-16: the split count
# depends on the rows alone, as a captured graph needs. 0: never.
SPLIT_KV_PROGRAMS, MAX_SPLITS = 128, 8
MANY_ROWS, MANY_ROWS_BLOCK_N = 256, 64
# Under grouped-query attention with at least so many query heads per KV head, both decode
# kernels (the row kernel and the fused one) run a program per row and KV head whose group
# of query heads attends in one tl.dot tile (padded to 16 rows), so each K/V tile is read
# once for the group instead of once per head (Nanbeige: 6 heads a group). Same-run A/B on
# an H200, Nanbeige 4.2-3B shape, on against off, prompt 1024 / output 64: 1.09x / 1.20x at
# concurrency 1 / 8 (the fused kernel), 1.65x / 2.04x at 32 / 64 (1.30x at 32 with fp8 K/V,
# 1.28x under --waves 4); prompt 64: 1.17x / 1.31x at concurrency 64 / 256. Models without
# grouping (Ouro) never take it. 0: never.
GROUPED_DECODE_HEADS = 2
FEW_ROWS, FEW_ROWS_WARPS, MANY_ROWS_WARPS = 16, 4, 2
# A head group's tl.dot tiles: at 2 warps the kernel takes 236+ registers on sm_90.
GROUPED_WARPS = 4

# RoPE + KV write: a program per row and head below this many rows, one per row from it on
# (measured on an H200: 4-8x faster at 512-1024 rows, but decode at 8 rows lost 13%).
ROPE_BY_ROW = 64

# Programmatic dependent launch where the GPU has it (Hopper and newer).
USE_PDL = True


def _dense_linear(x: torch.Tensor, weight: Weight, pdl: bool = False) -> torch.Tensor:
    """x @ weight.T for many rows: cuBLAS; for an fp8 weight FP8 tensor cores (bf16 activations,
    whose rowwise-scaled product cuBLAS gives only in bf16) or else the widened weight."""
    if not isinstance(weight, Fp8Weight):
        return F.linear(x, weight)
    if fp8_tensor_cores_take(x.dtype, weight):
        return fp8_product(quantize_rows(x, pdl), weight, pdl=pdl)
    return fp8_linear_reference(x, weight)


def _activations_out(rows: int, n: int, like: torch.Tensor, next_weight: Weight | None):
    """(the result, the tensor a norm or SiLU-mul kernel stores into, its scale pointer (not
    read unless float8), whether float8) for [rows, n] activations in `like`'s dtype that
    `next_weight` multiplies next."""
    if takes_fp8_rows(rows, like.dtype, next_weight):
        out = empty_fp8_rows(rows, n, like.dtype, like.device)
        return out, out.data, out.scale, True
    out = like.new_empty(rows, n)
    return out, out, out, False


def decode_splits(rows: int, heads: int) -> int:
    """Runs of key tiles per row and head in a decode pass (see SPLIT_KV_PROGRAMS)."""
    splits = 1
    while splits < MAX_SPLITS and rows * heads * splits * 2 <= SPLIT_KV_PROGRAMS:
        splits *= 2
    return splits


class TritonOps:
    """LoopOps (ops/base.py) on Triton kernels; graph-safe: no host reads, launch shapes
    depend only on the number of rows."""

    needs_segments = False

    def __init__(self) -> None:
        # Every kernel here waits for its predecessor on the device (kernels/pdl.py), so
        # each may be launched before the previous one has finished.
        self.pdl = USE_PDL and pdl_supported()

    def prefill_tile_rows(self, dtype: torch.dtype) -> int:
        """Query rows per prefill tile; float32 tiles are smaller (exact dots need more
        registers)."""
        return 16 if dtype == torch.float32 else 32

    def token_stats(self, logits, tokens, ban: TokenBan | None = None, live=None):
        """One read of each live row's logits (kernels/token_stats.py)."""
        return token_stats(logits.contiguous(), tokens, ban, live)

    def sample_plain(
        self,
        logits: torch.Tensor,
        temperature: torch.Tensor,
        seeds: torch.Tensor,
        counters: torch.Tensor,
        ban: TokenBan | None = None,
    ) -> torch.Tensor:
        """One read of each row's logits, no sort (kernels/gumbel_sample.py)."""
        return gumbel_sample(logits.contiguous(), temperature, seeds, counters, ban)

    def sample_filtered(
        self, logits: torch.Tensor, settings: SamplingTensors, counters: torch.Tensor
    ) -> torch.Tensor:
        """No sort: where the filters cut is searched for (kernels/filter_bound.py)."""
        return sample_filtered(logits, settings, counters)

    def rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, next_weight: Weight | None = None
    ) -> torch.Tensor | Fp8Rows:
        """Float8 rows with their scales where `next_weight`'s product runs on FP8 tensor
        cores (the quantize in the norm's epilogue)."""
        rows, n = x.shape
        out, data, scale, fp8 = _activations_out(rows, n, x, next_weight)
        block = triton.next_power_of_2(n)
        if rows:
            _rms_norm_kernel[(rows,)](
                x,
                weight,
                data,
                scale,
                x.stride(0),
                n,
                n,
                eps,
                BLOCK=block,
                FP8_OUT=fp8,
                FP8_RANGE=FP8_MAX,
                num_warps=row_warps(block),
                **launch_options(self.pdl),
            )
        return out

    def add_rms_norm2(
        self,
        x: torch.Tensor,
        branch: torch.Tensor,
        w_branch,
        w_next,
        eps: float,
        next_weight: Weight | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | Fp8Rows]:
        return self._add_rms_norm2(x, branch.unsqueeze(0), w_branch, w_next, eps, next_weight)

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
    ) -> tuple[torch.Tensor, torch.Tensor | Fp8Rows]:
        """add_rms_norm2(x, inp @ weight.T, ...); under a split-K plan the GEMM leaves float32
        partial sums and the norm kernel adds them up, so no reduction kernel runs (FP8
        tensor-core products too); the few-row CUDA kernel does the add and norms in its
        last block. With `live`, the product skips idle row tiles (`linear`) and the norm
        kernel follows it."""
        norms = (w_branch, w_next, eps, next_weight)
        if live is not None:
            return self.add_rms_norm2(x, self.linear(inp, weight, live), *norms)
        if not isinstance(inp, Fp8Rows) and takes_fp8_rows(inp.shape[0], inp.dtype, weight):
            inp = quantize_rows(inp, self.pdl)  # attention's output: no kernel hands it on
        if isinstance(inp, Fp8Rows):
            return self._add_rms_norm2(x, fp8_product(inp, weight, True, self.pdl), *norms)
        bf16 = all(t is None or t.dtype == torch.bfloat16 for t in (x, w_branch, w_next))
        if bf16 and x.stride(1) == 1 and takes_few_row(inp, weight):
            return few_row_gemm_add_norms(x, inp, weight, w_branch, w_next, eps, pdl=self.pdl)
        config = linear_plan(inp, weight, split_ok=True)
        if config is None or config.split_k == 1 or takes_strip(inp, weight):
            return self.add_rms_norm2(x, self.linear(inp, weight), *norms)
        parts = skinny_linear_partials(inp, weight, config, pdl=self.pdl)
        return self._add_rms_norm2(x, parts, *norms)

    def _add_rms_norm2(
        self, x: torch.Tensor, parts: torch.Tensor, w_branch, w_next, eps: float, next_weight
    ) -> tuple[torch.Tensor, torch.Tensor | Fp8Rows]:
        """parts: [slices, rows, hidden], the branch as partial sums (one slice: finished)."""
        rows, n = x.shape
        x_out = torch.empty_like(x)
        normed, data, scale, fp8 = _activations_out(rows, n, x, next_weight)
        block = triton.next_power_of_2(n)
        if rows:
            _add_rms_norm2_kernel[(rows,)](
                x,
                parts,
                w_next if w_branch is None else w_branch,
                w_next,
                x_out,
                data,
                x.stride(0),
                parts.stride(1),
                parts.stride(0),
                scale,
                n,
                eps,
                BLOCK=block,
                PARTS=parts.shape[0],
                NORM_BRANCH=w_branch is not None,
                FP8_OUT=fp8,
                FP8_RANGE=FP8_MAX,
                num_warps=row_warps(block),
                **launch_options(self.pdl),
            )
        return x_out, normed

    def silu_mul(
        self, gate_up: torch.Tensor, next_weight: Weight | None = None
    ) -> torch.Tensor | Fp8Rows:
        """SiLU(gate) * up from interleaved columns gate_0, up_0, gate_1, up_1, ...; as
        float8 rows where `next_weight`'s product takes them (a program per whole row)."""
        rows, double = gate_up.shape
        inter = double // 2
        out, data, scale, fp8 = _activations_out(rows, inter, gate_up, next_weight)
        block = triton.next_power_of_2(inter) if fp8 else 1024
        if rows:
            _silu_mul_kernel[(rows, triton.cdiv(inter, block))](
                gate_up,
                data,
                scale,
                gate_up.stride(0),
                inter,
                BLOCK=block,
                FP8_OUT=fp8,
                FP8_RANGE=FP8_MAX,
                num_warps=8 if block >= 4096 else 4,
                **launch_options(self.pdl),
            )
        return out

    def linear(
        self, x: torch.Tensor | Fp8Rows, weight: Weight, live: torch.Tensor | None = None
    ) -> torch.Tensor:
        """x @ weight.T; few rows stream the weight once, and with `live` a row tile none of
        whose rows is live skips the weight (those rows' outputs are zero)."""
        if isinstance(x, Fp8Rows):
            return fp8_product(x, weight, pdl=self.pdl)
        if live is None and takes_few_row(x, weight):
            return few_row_gemm(x, weight, pdl=self.pdl)
        if live is None and takes_strip(x, weight):
            return strip_gemv(x, weight, pdl=self.pdl)
        config = linear_plan(x, weight, live=live is not None)
        if config is None:
            return _dense_linear(x, weight, self.pdl)
        return skinny_linear(x, weight, config, live=live, pdl=self.pdl)

    def linear_silu_mul(
        self, x: torch.Tensor | Fp8Rows, gate_up: Weight, next_weight: Weight | None = None
    ) -> torch.Tensor | Fp8Rows:
        """silu_mul(x @ gate_up.T); few rows do the SiLU-mul in the GEMM's epilogue."""
        if isinstance(x, Fp8Rows):
            act = fp8_silu_mul_epilogue(x, gate_up, next_weight, self.pdl)
            if act is None:
                return self.silu_mul(fp8_product(x, gate_up, pdl=self.pdl), next_weight)
            return act
        if takes_few_row(x, gate_up):
            return few_row_gemm(x, gate_up, silu_mul=True, pdl=self.pdl)
        if takes_strip(x, gate_up):
            return strip_gemv(x, gate_up, silu_mul=True, pdl=self.pdl)
        config = linear_plan(x, gate_up)
        if config is None:
            return self.silu_mul(_dense_linear(x, gate_up, self.pdl), next_weight)
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
        kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """As TorchOps.attention: kv_scales apply to a float8 cache only."""
        rows = qkv.shape[0]
        head_dim = k_cache.shape[-1]
        q = qkv.new_empty(rows, num_heads, head_dim)
        # A captured pass's padding rows are in no tile and past the decode rows: zeros keep
        # them finite, and so the K/V they write to the dummy block.
        padded = meta.device_counts is not None
        out = torch.zeros_like(q) if padded else torch.empty_like(q)
        if rows == 0:
            return out.reshape(rows, -1)
        applied = applied_kv_scales(kv_scales, k_cache)
        scaled = applied is not None
        k_scale, v_scale = applied or (meta.positions, meta.positions)  # not read when unscaled
        caches = (k_cache, v_cache, k_scale, v_scale)
        shape = attention_shape(num_heads, num_kv_heads, head_dim, scaled)
        tiles, counts = meta.prefill_tiles, meta.device_counts
        fused = rows <= FUSED_DECODE_ROWS and meta.rows_independent
        head_grid, group_tile = self._head_grid(num_heads, num_kv_heads)
        if fused and tiles is None and counts is None:
            splits = decode_splits(rows, head_grid)
            parts = self._split_parts(out, splits)
            _rope_attend_kernel[(rows, head_grid, splits)](
                qkv,
                q,
                *caches,
                out,
                meta.positions,
                rotary.cos,
                rotary.sin,
                meta.row_entry,
                meta.write_lo,
                meta.write_hi,
                meta.row_tables,
                meta.read_plane,
                meta.block_table,
                parts,
                qkv.stride(0),
                meta.block_table.stride(0),
                meta.slots_per_plane,
                meta.block_size,
                scale,
                **shape,
                PLANES=meta.planes,
                SPLITS=splits,
                GROUP_TILE=group_tile,
                **self._decode_launch(rows, grouped=group_tile > 0),
                **launch_options(self.pdl),
            )
            self._combine_splits(parts, v_scale, out, rows, shape, splits)
            return out.reshape(rows, -1)
        args = (qkv, q, *caches, meta.positions, rotary.cos, rotary.sin)
        args += (meta.row_entry, meta.write_lo, meta.write_hi, qkv.stride(0), meta.slots_per_plane)
        if rows >= ROPE_BY_ROW:
            _rope_write_rows_kernel[(rows,)](
                *args,
                **shape,
                HEADS_P2=triton.next_power_of_2(num_heads),
                KV_HEADS_P2=triton.next_power_of_2(num_kv_heads),
                PLANES=meta.planes,
                num_warps=8,
                **launch_options(self.pdl),
            )
        else:
            _rope_write_kernel[(rows, num_heads + num_kv_heads)](
                *args,
                **shape,
                PLANES=meta.planes,
                **launch_options(self.pdl),
            )
        if counts is None:
            row_grid, tile_grid = (rows if tiles is None else meta.num_decode), 0
            count_ptr = meta.positions  # not read
            if tiles is not None:
                tile_grid = tiles.num_tiles
        else:
            row_grid, tile_grid = counts.row_programs, counts.tile_programs
            count_ptr = counts.counts
        if tiles is not None and tile_grid:
            exact = q.dtype == torch.float32
            _prefill_attention_kernel[(tile_grid, num_heads)](
                q,
                *caches,
                out,
                tiles.fields,
                tiles.fields.stride(0),
                count_ptr[1:],
                meta.block_table,
                meta.block_table.stride(0),
                meta.slots_per_plane,
                meta.block_size,
                scale,
                **shape,
                BLOCK_M=self.prefill_tile_rows(q.dtype),
                BLOCK_N=16 if exact else 32,
                IEEE=exact,
                PERSISTENT=counts is not None,
                num_warps=4,
                **launch_options(self.pdl),
            )
        if row_grid == 0:
            return out.reshape(rows, -1)
        cuda = cuda_decode.takes_cuda_decode(q, k_cache, num_kv_heads, row_grid)
        rule = cuda_decode.decode_splits if cuda else decode_splits
        splits = 1 if counts is not None else rule(row_grid, num_kv_heads if cuda else head_grid)
        parts = self._split_parts(out, splits)
        if cuda:
            count = None if counts is None else counts.counts
            args = (q, caches, scaled, out, parts, meta, row_grid, splits, count, scale)
            cuda_decode.paged_decode(*args, self.pdl)
        else:
            args = (q, caches, out, parts, meta, row_grid, count_ptr, counts is not None)
            self._triton_decode(*args, shape, scale)
        self._combine_splits(parts, v_scale, out, row_grid, shape, splits)
        return out.reshape(rows, -1)

    def _triton_decode(self, q, caches, out, parts, meta, grid, count_ptr, bounded, shape, scale):
        """The Triton row kernel over `grid` row programs (see attention)."""
        splits = 1 if parts is out else parts.shape[2]
        head_grid, group_tile = self._head_grid(shape["NUM_HEADS"], shape["NUM_KV_HEADS"])
        _paged_attention_kernel[(grid, head_grid, splits)](
            q,
            *caches,
            out,
            meta.positions,
            meta.row_tables,
            meta.read_plane,
            meta.block_table,
            count_ptr,
            meta.block_table.stride(0),
            meta.slots_per_plane,
            meta.block_size,
            scale,
            parts,
            **shape,
            **self._decode_launch(grid, bounded=bounded, grouped=group_tile > 0),
            SPLITS=splits,
            GROUP_TILE=group_tile,
            PERSISTENT=bounded,
            **launch_options(self.pdl),
        )

    @staticmethod
    def _split_parts(out: torch.Tensor, splits: int) -> torch.Tensor:
        """Each split's unnormalised (acc, max, sum) per row and head; one split: `out`."""
        if splits == 1:
            return out
        rows, heads, head_dim = out.shape
        return out.new_empty(rows, heads, splits, head_dim + 2, dtype=torch.float32)

    def _combine_splits(self, parts, v_scale, out, rows: int, shape: dict, splits: int) -> None:
        """Split-KV's second kernel: the first `rows` rows' runs into `out`."""
        if splits > 1:
            _combine_splits_kernel[(rows, out.shape[1])](
                parts, v_scale, out, **shape, SPLITS=splits, **launch_options(self.pdl)
            )

    @staticmethod
    def _head_grid(num_heads: int, num_kv_heads: int) -> tuple[int, int]:
        """Decode attention's programs per row and the query-head tile each attends with:
        one per query head (tile 0), or under grouping one per KV head, its group padded
        to a tl.dot tile of at least 16 rows."""
        group = num_heads // num_kv_heads
        if 0 < GROUPED_DECODE_HEADS <= group:
            return num_kv_heads, max(16, triton.next_power_of_2(group))
        return num_heads, 0

    @staticmethod
    def _decode_launch(rows: int, bounded: bool = False, grouped: bool = False) -> dict:
        """The launch shape of the decode kernels over `rows` programs per head: one per
        row, or the bounded grid of a captured prompt pass (which keeps 128-key tiles)."""
        warps = FEW_ROWS_WARPS if rows <= FEW_ROWS else MANY_ROWS_WARPS
        return dict(
            BLOCK_N=MANY_ROWS_BLOCK_N if rows >= MANY_ROWS and not bounded else DECODE_BLOCK_N,
            STAGES=DECODE_STAGES,
            num_warps=GROUPED_WARPS if grouped else warps,
        )
