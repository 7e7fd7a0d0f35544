"""The initial state's truncated normal draw (layers/initial_state.py) as one kernel.

In torch, the counter-based hash, the inverse normal CDF and the scaling are some 50
elementwise kernels over [rows, hidden] int64 and float64 tensors, and a Huginn pass draws
twice (for the rows at their first loop, and the latent_diff policy's reference): about a
hundred launches a pass. Here one program per (row, block of columns) takes the same
steps: the same 32-bit hash as `seeded_uniform`, the same float64 steps in the same order
with no fused multiply-add, and libdevice's erfinv, the CUDA math function torch's CUDA
erfinv calls; tests/gpu checks that the bits are the same.
"""

from __future__ import annotations

import math
import struct
import sys

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import libdevice

from vllm_rlt.kernels.gumbel_sample import _mix32
from vllm_rlt.layers.initial_state import LOW, STATE_STREAM, truncated_normal

BLOCK = 1024  # columns a program draws


@triton.jit
def _truncated_normal_kernel(
    seed_ptr,  # [rows] int64
    stream_key,  # int64 mixed into every seed (the state's stream)
    position_ptr,  # [rows] int64
    out_ptr,  # [rows, width]
    width,
    low_bits,  # Phi(-truncation): the bits of a float64 (a float argument is a float32)
    span_bits,  # 1 - 2 * low, as bits
    std_sqrt2_bits,  # std * sqrt(2), as bits
    scale,  # float32
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < width
    seed = tl.load(seed_ptr + row) ^ stream_key
    position = tl.load(position_ptr + row)
    seed_lo = (seed & 0xFFFFFFFF).to(tl.uint32)
    seed_hi = ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
    stream = _mix32(_mix32(seed_lo ^ _mix32(seed_hi + 0x9E3779B9)) ^ position.to(tl.uint32))
    bits = _mix32(stream ^ _mix32(cols.to(tl.uint32) + 0x632BE5AB))
    low = low_bits.to(tl.float64, bitcast=True)
    span = span_bits.to(tl.float64, bitcast=True)
    std_sqrt2 = std_sqrt2_bits.to(tl.float64, bitcast=True)
    uniform = ((bits >> 8).to(tl.float64) + 0.5) / 16777216.0
    p = low + uniform * span
    draw = (std_sqrt2 * libdevice.erfinv(2.0 * p - 1.0)).to(tl.float32)
    out = (draw * scale).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * width + cols, out, mask=inside)


def truncated_normal_cuda(
    seeds: torch.Tensor,  # [rows] int64
    positions: torch.Tensor,  # [rows] int64
    width: int,
    std: float,
    scale: float = 1.0,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """[rows, width] of `dtype`: the draws of layers/initial_state.truncated_normal."""
    if std * math.sqrt(2) < sys.float_info.min:  # subnormal: its bits would fit 32 bits
        return truncated_normal(seeds, positions, width, std, scale, dtype)
    rows = seeds.shape[0]
    out = torch.empty(rows, width, dtype=dtype, device=seeds.device)
    if rows:
        _truncated_normal_kernel[(rows, triton.cdiv(width, BLOCK))](
            seeds.contiguous(),
            STATE_STREAM,
            positions.contiguous(),
            out,
            width,
            _bits(LOW),
            _bits(1 - 2 * LOW),
            _bits(std * math.sqrt(2)),
            scale,
            BLOCK=BLOCK,
            enable_fp_fusion=False,  # torch rounds every product and sum
        )
    return out


def _bits(value: float) -> int:
    """A positive normal float64's bits as an int64 argument (between 2^52 and 2^63, so
    Triton types it int64)."""
    return struct.unpack("<q", struct.pack("<d", value))[0]
