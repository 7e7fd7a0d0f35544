"""CUDA graphs of the layer stack between attention calls, for passes with prefill rows.

A pass that carries prefill chunks cannot be one graph: its chunks' lengths, positions and
tiles change every pass. Launched eagerly, though, its ~150 kernels cost the host several
milliseconds, and under steady load nearly every pass carries a chunk (each admitted
request's prompt runs one loop per pass). So the stack is cut at its attention calls: the
pieces between them (norms, projections, MLP, residual adds) are captured once per padded
row count and replayed, and only attention, which reads the pass's metadata, runs eagerly.

The pieces of every size share one memory pool and four buffers sized for the largest: the
input state, the q/k/v the attention reads, the attention output the next piece reads, and
the loop's output. A pass copies its rows into the input and clones its rows of the output,
so nothing a later pass replays can overwrite what this one returns. Padding rows hold
whatever an earlier pass left: every op in a piece works row by row, and attention only
runs the pass's own rows, so they never reach a real row.
"""

from __future__ import annotations

import contextlib
import gc
import sys
from dataclasses import dataclass
from typing import Any

import torch
from tqdm import tqdm

from vllm_rlt.worker.cuda_graphs import collection_paused

# Passes with more rows than this run the stack eagerly: their launches are a small part
# of their device time.
MAX_PIECE_ROWS = 512


def piece_sizes(max_rows: int) -> list[int]:
    """Padded row counts for passes of up to `max_rows` rows (capped at MAX_PIECE_ROWS):
    8, then steps of 8 to 64, of 32 to 256, of 128 beyond."""
    cap = min(max_rows, MAX_PIECE_ROWS)
    sizes, size = [], 8
    while size < cap:
        sizes.append(size)
        size += 8 if size < 64 else 32 if size < 256 else 128
    sizes.append(cap)
    return sizes


@dataclass
class _AttentionCall:
    """What one layer's attention needs beyond the pass's rows and metadata."""

    num_heads: int
    num_kv_heads: int
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    rotary: Any
    scale: float


class _Splitter:
    """Stands in for the ops while the stack runs for capture: each attention call ends the
    piece being captured, starts the next, and hands the model the attention buffer."""

    def __init__(self, owner: PiecewiseGraphs, size: int, capture: bool) -> None:
        self.owner, self.size, self.capture = owner, size, capture
        self.graphs: list[torch.cuda.CUDAGraph] = []
        self.calls: list[_AttentionCall] = []
        self.capturing = False
        if capture:
            self._begin()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.owner.ops, name)

    def _begin(self) -> None:
        graph = torch.cuda.CUDAGraph()
        graph.capture_begin(pool=self.owner.pool)
        self.graphs.append(graph)
        self.capturing = True

    def _end(self) -> None:
        self.capturing = False
        self.graphs[-1].capture_end()

    def abandon(self) -> None:
        """After an error inside a capture: end it, so the stream is usable again (the
        original error is the one to report)."""
        if self.capture and self.capturing:
            with contextlib.suppress(RuntimeError):
                self._end()

    def attention(self, qkv, num_heads, num_kv_heads, k_cache, v_cache, meta, rotary, scale):
        owner, size = self.owner, self.size
        owner.qkv[:size].copy_(qkv)
        self.calls.append(_AttentionCall(num_heads, num_kv_heads, k_cache, v_cache, rotary, scale))
        if self.capture:
            self._end()
            self._begin()
        return owner.attn[:size]

    def finish(self, output: torch.Tensor) -> None:
        self.owner.output[: self.size].copy_(output)
        if self.capture:
            self._end()


def buffer_bytes(config, dtype: torch.dtype, rows: int) -> int:
    """Bytes of the buffers `PiecewiseGraphs` keeps for passes of up to `rows` rows."""
    width = 2 * config.hidden_size
    width += (2 * config.num_attention_heads + 2 * config.num_key_value_heads) * config.head_dim
    return rows * width * torch.empty((), dtype=dtype).element_size()


class PiecewiseGraphs:
    """Replays `model.core` for passes of up to `sizes[-1]` rows as captured pieces with
    eager attention between them (see the module docstring)."""

    def __init__(self, model, ops, k_caches, v_caches, pool, sizes: list[int]) -> None:
        self.model, self.ops = model, ops
        self.k_caches, self.v_caches = k_caches, v_caches
        self.pool = pool
        self.sizes = sizes
        cfg, largest = model.config, sizes[-1]
        qkv_width = (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * cfg.head_dim
        attn_width = cfg.num_attention_heads * cfg.head_dim
        # Zeroed: padding rows must hold finite values from the start.
        like = {"dtype": model.dtype, "device": model.device}
        self.input = torch.zeros(largest, cfg.hidden_size, **like)
        self.qkv = torch.zeros(largest, qkv_width, **like)
        self.attn = torch.zeros(largest, attn_width, **like)
        self.output = torch.zeros(largest, cfg.hidden_size, **like)
        self.pieces: dict[int, tuple[list[torch.cuda.CUDAGraph], list[_AttentionCall]]] = {}
        # Every size is captured on this one stream: the caching allocator reuses a freed
        # block of the pool only on the stream that allocated it, so the sizes share their
        # scratch memory only if they share the stream.
        self.stream = torch.cuda.Stream(model.device)
        self.num_replays = 0  # passes served, for tests

    def fits(self, rows: int) -> bool:
        return 0 < rows <= self.sizes[-1]

    def capture_all(self) -> None:
        """Capture every size now, largest first, so no request pays for a capture."""
        gc.collect()
        sizes = list(reversed(self.sizes))
        for size in tqdm(sizes, desc="capturing layer pieces", unit="size", file=sys.stderr):
            self._capture(size)

    def _run_stack(self, size: int, capture: bool) -> _Splitter:
        splitter = _Splitter(self, size, capture)
        try:
            out = self.model.core(self.input[:size], None, self.k_caches, self.v_caches, splitter)
            splitter.finish(out)
        except BaseException:
            splitter.abandon()
            raise
        return splitter

    def _capture(self, size: int) -> None:
        # Warm up first (compiles kernels, sets up cuBLAS at this size).
        stream = self.stream
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self._run_stack(size, capture=False)
        stream.synchronize()
        with collection_paused(), torch.cuda.stream(stream):
            splitter = self._run_stack(size, capture=True)
        torch.cuda.current_stream().wait_stream(stream)
        self.pieces[size] = (splitter.graphs, splitter.calls)

    def core(self, hidden: torch.Tensor, meta) -> torch.Tensor:
        """`model.core(hidden, meta, ...)` for `hidden`'s rows (at most the largest size)."""
        rows = hidden.shape[0]
        size = next(s for s in self.sizes if s >= rows)
        graphs, calls = self.pieces[size]
        self.input[:rows].copy_(hidden)
        qkv, attn = self.qkv[:rows], self.attn[:rows]
        for graph, call in zip(graphs, calls, strict=False):
            graph.replay()
            self.ops.attention(
                qkv,
                call.num_heads,
                call.num_kv_heads,
                call.k_cache,
                call.v_cache,
                meta,
                call.rotary,
                call.scale,
                out=attn,
            )
        graphs[-1].replay()
        self.num_replays += 1
        return self.output[:rows].clone()
