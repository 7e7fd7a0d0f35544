"""CUDA graphs of decode-only passes, one per padded batch size and sampling variant."""

from __future__ import annotations

import contextlib
import gc
import sys
from collections.abc import Callable

import torch
from tqdm import tqdm

from vllm_rlt.layers.sampler import SamplingMode
from vllm_rlt.sampling_params import MAX_LOGPROBS

# The sampling modes captured at start-up; a pass with filters captures its graph when it
# first comes (the sort over the vocabulary makes those passes slow anyway).
EAGER_MODES = (SamplingMode.GREEDY, SamplingMode.PLAIN)


@contextlib.contextmanager
def collection_paused():
    """No garbage collection inside a capture: freeing an unreachable engine's graphs there
    would invalidate it."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if collecting:
            gc.enable()


def graph_batch_sizes(max_slots: int) -> list[int]:
    """1, 2, 4, 8, then steps of 8 up to 64, then of 32: padding stays small."""
    sizes, size = [], 1
    while size < min(max_slots, 8):
        sizes.append(size)
        size *= 2
    size = 8
    while size < max_slots:
        sizes.append(size)
        size += 8 if size < 64 else 32
    sizes.append(max_slots)
    return sorted(set(sizes))


class DecodeGraphs:
    """Captures decode-only passes and replays them.

    Padding rows point at the dummy slot, whose block table addresses the dummy block.
    Inputs (the slot list) and outputs live in buffers with fixed addresses; the slot list
    goes in and the packed results come out through pinned memory. `capture_all`
    records the common variants of every size up front; the rest are captured on first use.
    """

    def __init__(
        self,
        decode_pass: Callable[[torch.Tensor, SamplingMode, int, bool, bool], torch.Tensor],
        dummy_slot: int,
        upload: Callable[..., torch.Tensor],
        device: torch.device,
        with_lanes: bool,
    ) -> None:
        """`decode_pass(slots, mode, num_top, adjusted, speculating)`: the packed results
        of a decode-only pass over the device tensor `slots` (what a graph records);
        `upload(values, out=buffer)`: host ints into a device buffer without waiting;
        `with_lanes`: the engine speculates, so graphs with lanes are captured up front."""
        self.decode_pass = decode_pass
        self.dummy_slot = dummy_slot
        self.upload = upload
        self.with_lanes = with_lanes
        self.sizes = graph_batch_sizes(dummy_slot)
        largest = self.sizes[-1]
        self.slots = torch.full((largest,), dummy_slot, dtype=torch.int64, device=device)
        self.pool = torch.cuda.graph_pool_handle()
        # (batch size, sampling mode, with top logprobs, with logit adjustments, with
        # speculation lanes) -> graph, output
        self.graphs: dict[
            tuple[int, SamplingMode, bool, bool, bool], tuple[torch.cuda.CUDAGraph, torch.Tensor]
        ] = {}

    def replay(
        self,
        decode_slots: tuple[int, ...],
        mode: SamplingMode,
        num_top: int,
        adjusted: bool = False,
        speculating: bool = False,
    ) -> torch.Tensor:
        """Enqueue the pass; returns the packed results [len(decode_slots), fields]."""
        count = len(decode_slots)
        size = next(s for s in self.sizes if s >= count)
        key = (size, mode, num_top > 0, adjusted, speculating)
        if key not in self.graphs:
            self._capture(key)
        padded = list(decode_slots) + [self.dummy_slot] * (size - count)
        self.upload(padded, out=self.slots[:size])
        graph, output = self.graphs[key]
        graph.replay()
        return output[:count]

    def capture_all(self) -> None:
        """Capture every size, greedy and sampling with no filter, now (largest first, so
        the smaller ones reuse its memory): otherwise the first pass of a new batch size
        would pay its capture inside some request's latency; with speculation, the
        variants with lanes too. Variants with filters (top-k, top-p, min-p, top-n-sigma),
        top logprobs or logit adjustments stay lazy."""
        lanes = (False, True) if self.with_lanes else (False,)
        keys = [
            (size, mode, False, False, speculating)
            for size in reversed(self.sizes)
            for mode in EAGER_MODES
            for speculating in lanes
        ]
        gc.collect()  # free what an earlier engine left, before its memory is needed
        for key in tqdm(keys, desc="capturing CUDA graphs", unit="graph", file=sys.stderr):
            if key not in self.graphs:
                self._capture(key)

    def _capture(self, key: tuple[int, SamplingMode, bool, bool, bool]) -> None:
        size, mode, with_top, adjusted, speculating = key
        num_top = MAX_LOGPROBS if with_top else 0
        slots = self.slots[:size]
        slots.fill_(self.dummy_slot)  # padding rows only: no real slot's state moves
        self.graphs[key] = capture(
            lambda: self.decode_pass(slots, mode, num_top, adjusted, speculating), self.pool
        )


def capture(step, pool) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """(graph, output) of `step()` captured into `pool`. It runs once on a side stream first
    (compiles kernels, sets up cuBLAS at these shapes), so its inputs must touch only padding
    state; the capture itself records work without running it."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with collection_paused(), torch.cuda.graph(graph, pool=pool):
        output = step()
    return graph, output
