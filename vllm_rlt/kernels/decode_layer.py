"""One sandwich decoder layer of a decode pass for 1 to 16 rows in one launch
(csrc/decode_layer.cu): qkv, RoPE with the K/V write and paged attention, o with the
residual add and norms, gate_up with SiLU-mul and down with the residual add and the next
norm, in a grid of one block per SM whose units wait on counters, not on the kernels before
them. It removes the launches and tails of the eight kernels a layer takes at these row
counts. Each block stages a product's x in dynamic shared memory (staged_x_bytes). Every
block must be resident at once, so the kernel needs the GPU to itself: a kernel of another
stream that held SMs until this one ended would stall it. A (row, head) attends on one
block, so at a few rows and thousands of positions most SMs idle through attention (the
Triton chain splits such contexts over programs). Measured against that chain by
benchmarks/probe_decode_layer.py; the engine does not take it yet.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Protocol

import torch

from vllm_rlt.kernels.counter_ring import CounterRing
from vllm_rlt.kernels.cuda_build import cuda_module
from vllm_rlt.kernels.cuda_driver import CudaModule
from vllm_rlt.layers.fp8 import Fp8Weight


class DecodeRows(Protocol):
    """What the kernel reads of a pass's attention metadata (ops/metadata.py's
    AttentionMetadata has it): per-row int64 tensors and the cache's geometry."""

    positions: torch.Tensor
    row_tables: torch.Tensor
    read_plane: torch.Tensor
    write_lo: torch.Tensor
    write_hi: torch.Tensor
    row_entry: torch.Tensor
    block_table: torch.Tensor
    slots_per_plane: int
    block_size: int
    rows_independent: bool
    device_counts: object | None
    prefill_tiles: object | None


HEAD_DIM = 128  # the kernel's head size
MAX_ROWS = 16
COUNTERS_PER_LAUNCH = 64  # heads + kv_heads + 5 at most
RING = 1024  # launches whose counters may be in flight at once
# Dynamic shared memory the staged x may take: an H100's or H200's 227 KB a block, less
# 40 KB for the kernel's static arrays.
STAGED_X_LIMIT = (227 - 40) * 1024


def staged_x_bytes(rows: int, hidden: int, inter: int) -> int:
    """The shared memory stage_x takes for the widest x of a layer: 8 or 16 rows (as the
    kernel's variant) of max(hidden, inter) bf16 values and a 16-byte word of padding."""
    return (8 if rows <= 8 else 16) * (max(hidden, inter) * 2 + 16)


_pointer, _int, _float = ctypes.c_void_p, ctypes.c_int, ctypes.c_float


class LayerArgs(ctypes.Structure):
    """The kernel's argument, field for field as csrc/decode_layer.cu declares it."""

    _fields_ = [
        *((name, _pointer) for name in ("x", "a", "w_qkv", "s_qkv", "w_o", "s_o")),
        *((name, _pointer) for name in ("w_gate_up", "s_gate_up", "w_down", "s_down")),
        *((name, _pointer) for name in ("attn_out_norm", "mlp_norm", "mlp_out_norm")),
        *((name, _pointer) for name in ("next_norm", "cos", "sin", "k_cache", "v_cache")),
        *((name, _pointer) for name in ("positions", "row_tables", "read_plane", "write_lo")),
        *((name, _pointer) for name in ("write_hi", "row_entry", "block_table", "qkv", "attn")),
        *((name, _pointer) for name in ("o", "x_mid", "b", "mlp", "down", "x_out", "a_out")),
        ("counters", _pointer),
        ("trace", _pointer),
        *((name, _int) for name in ("rows", "hidden", "inter", "heads", "kv_heads")),
        *((name, _int) for name in ("slots_per_plane", "block_size", "block_table_stride")),
        ("eps", _float),
        ("scale", _float),
        ("pdl", _int),
    ]


@dataclass
class SandwichWeights:
    """One layer's weights as the kernel takes them: bf16 or float8 products (gate_up's rows
    interleave gate and up) and bf16 norms around each branch."""

    qkv: torch.Tensor | Fp8Weight  # [(heads + 2 kv_heads) * 128, hidden]
    o: torch.Tensor | Fp8Weight  # [hidden, hidden]
    gate_up: torch.Tensor | Fp8Weight  # [2 inter, hidden]
    down: torch.Tensor | Fp8Weight  # [hidden, inter]
    attn_out_norm: torch.Tensor  # [hidden]
    mlp_norm: torch.Tensor
    mlp_out_norm: torch.Tensor

    def products(self) -> tuple:
        return self.qkv, self.o, self.gate_up, self.down


# What a traced launch's row of each block holds (decode_layer's `trace`): %globaltimer in
# nanoseconds at the block's start, then at the end of each of its phases, then at steps
# inside them (the norms' only in the block that runs them, zero elsewhere).
PHASES = ("start", "qkv", "attention", "o and norms", "gate_up", "down and norms")
STEPS = ("o: last tile in", "o: norms written", "gate_up: b staged", "down: last tile in")
STEPS += ("down: norms written",)
TRACE_SLOTS = 12  # a block's row: PHASES, STEPS, one spare

# A launch's counters: per head and K/V head, then five for the phases.
COUNTERS = CounterRing("decode_layer", per_launch=COUNTERS_PER_LAUNCH, launches=RING)


def _module(device: torch.device) -> CudaModule | None:
    index = device.index if device.index is not None else torch.cuda.current_device()
    return cuda_module("decode_layer", index, min_capability=(9, 0))  # ld.acquire, griddepcontrol


def _tensors(weight: torch.Tensor | Fp8Weight) -> tuple[torch.Tensor, torch.Tensor]:
    return weight.tensors() if isinstance(weight, Fp8Weight) else (weight, weight)


def fits_decode_layer(
    x: torch.Tensor,
    a: torch.Tensor,
    weights: SandwichWeights,
    next_norm: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: DecodeRows,
    cos: torch.Tensor,
    heads: int,
) -> bool:
    """Whether the kernel can run this layer: 1-16 contiguous bf16 rows of decode only,
    whose rows read nothing another row writes; head size 128 with heads * 128 = hidden; a
    bf16 cache; products all bf16 or all float8 with whole, contiguous rows; 16-byte aligned
    rows and norms; x of the widest product staged in shared memory (STAGED_X_LIMIT); a
    GPU of sm_90 on."""
    rows, hidden = x.shape
    kv_heads = k_cache.shape[1]
    products = weights.products()
    fp8 = [isinstance(w, Fp8Weight) for w in products]
    bf16 = [x, a, cos, next_norm, weights.attn_out_norm, weights.mlp_norm, weights.mlp_out_norm]
    if not (1 <= rows <= MAX_ROWS and x.is_cuda and isinstance(a, torch.Tensor)):
        return False
    if any(t.dtype != torch.bfloat16 or not t.is_contiguous() for t in bf16):
        return False
    if any(t.data_ptr() % 16 for t in bf16) or a.shape != x.shape:
        return False
    if any(fp8) != all(fp8) or heads + kv_heads + 5 > COUNTERS_PER_LAUNCH:
        return False
    if not all(fp8) and any(w.dtype != torch.bfloat16 for w in products):
        return False
    if not (meta.rows_independent and meta.device_counts is None and meta.prefill_tiles is None):
        return False
    fields = (meta.positions, meta.row_tables, meta.read_plane, meta.write_lo, meta.write_hi)
    fields += (meta.row_entry, meta.block_table)
    if any(f.dtype != torch.int64 or f.stride(-1) != 1 for f in fields):
        return False
    data, scales = zip(*(_tensors(w) for w in products), strict=True)
    inter = data[3].shape[1]
    return (
        k_cache.dtype == torch.bfloat16
        and k_cache.shape[-1] == HEAD_DIM
        and v_cache.shape == k_cache.shape
        and v_cache.dtype == k_cache.dtype
        and cos.shape[-1] == HEAD_DIM
        and heads % kv_heads == 0
        and heads * HEAD_DIM == hidden
        and data[0].shape == ((heads + 2 * kv_heads) * HEAD_DIM, hidden)
        and data[1].shape == (hidden, hidden)
        and data[2].shape == (2 * inter, hidden)
        and data[3].shape == (hidden, inter)
        and hidden % 64 == 0
        and inter % 64 == 0
        and staged_x_bytes(rows, hidden, inter) <= STAGED_X_LIMIT
        and all(d.is_contiguous() and s.is_contiguous() for d, s in zip(data, scales, strict=True))
        and _module(x.device) is not None
    )


def decode_layer(
    x: torch.Tensor,  # [rows, hidden] bf16, the residual stream
    a: torch.Tensor,  # [rows, hidden] its pre-attention norm
    weights: SandwichWeights,
    next_norm: torch.Tensor,  # [hidden] the norm after the layer
    k_cache: torch.Tensor,  # [planes * slots_per_plane, kv_heads, 128] bf16
    v_cache: torch.Tensor,
    meta: DecodeRows,  # decode rows, independent (see the kernel)
    cos: torch.Tensor,  # [positions, 128] bf16
    sin: torch.Tensor,
    heads: int,
    eps: float,
    scale: float,
    pdl: bool = False,
    grid: int | None = None,  # blocks (default: one per SM; fewer take several units each)
    trace: torch.Tensor | None = None,  # int64 [grid, TRACE_SLOTS]: see PHASES
) -> tuple[torch.Tensor, torch.Tensor]:
    """(the stream after the layer, its next norm), each [rows, hidden]; graph-safe once run
    outside a capture. With `trace`, each block writes its timeline into its row."""
    assert fits_decode_layer(x, a, weights, next_norm, k_cache, v_cache, meta, cos, heads)
    rows, hidden = x.shape
    kv_heads = k_cache.shape[1]
    (w_qkv, s_qkv), (w_o, s_o), (w_gu, s_gu), (w_down, s_down) = map(_tensors, weights.products())
    inter = w_down.shape[1]
    width = (heads + 2 * kv_heads) * HEAD_DIM
    scratch = {
        "qkv": x.new_empty(rows, width),
        "attn": x.new_empty(rows, heads * HEAD_DIM),
        "o": x.new_empty(rows, hidden),
        "x_mid": x.new_empty(rows, hidden),
        "b": x.new_empty(rows, hidden),
        "mlp": x.new_empty(rows, inter),
        "down": x.new_empty(rows, hidden),
        "x_out": x.new_empty(rows, hidden),
        "a_out": x.new_empty(rows, hidden),
    }
    tensors = {
        "x": x,
        "a": a,
        "w_qkv": w_qkv,
        "s_qkv": s_qkv,
        "w_o": w_o,
        "s_o": s_o,
        "w_gate_up": w_gu,
        "s_gate_up": s_gu,
        "w_down": w_down,
        "s_down": s_down,
        "attn_out_norm": weights.attn_out_norm,
        "mlp_norm": weights.mlp_norm,
        "mlp_out_norm": weights.mlp_out_norm,
        "next_norm": next_norm,
        "cos": cos,
        "sin": sin,
        "k_cache": k_cache,
        "v_cache": v_cache,
        "positions": meta.positions,
        "row_tables": meta.row_tables,
        "read_plane": meta.read_plane,
        "write_lo": meta.write_lo,
        "write_hi": meta.write_hi,
        "row_entry": meta.row_entry,
        "block_table": meta.block_table,
        **scratch,
    }
    args = LayerArgs(**{name: t.data_ptr() for name, t in tensors.items()})
    args.counters = COUNTERS.next_address(x.device)
    grid = grid or torch.cuda.get_device_properties(x.device).multi_processor_count
    if trace is not None:
        assert trace.dtype == torch.int64 and trace.is_contiguous()
        assert trace.shape == (grid, TRACE_SLOTS)
        args.trace = trace.data_ptr()
    args.rows, args.hidden, args.inter, args.heads, args.kv_heads = (
        rows,
        hidden,
        inter,
        heads,
        kv_heads,
    )
    args.slots_per_plane, args.block_size = meta.slots_per_plane, meta.block_size
    args.block_table_stride = meta.block_table.stride(0)
    args.eps, args.scale, args.pdl = eps, scale, int(pdl)
    fp8 = isinstance(weights.qkv, Fp8Weight)
    name = "decode_layer_" + ("w8a16" if fp8 else "w16a16") + ("_n8" if rows <= 8 else "_n16")
    kernel = _module(x.device).kernel(name)
    stream = torch.cuda.current_stream(x.device).cuda_stream
    shared = staged_x_bytes(rows, hidden, inter)
    kernel.launch(grid, kernel.max_threads, stream, (args,), pdl=pdl, shared_bytes=shared)
    return scratch["x_out"], scratch["a_out"]
