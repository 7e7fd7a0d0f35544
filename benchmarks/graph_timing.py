"""Time GPU work as a CUDA graph, so the figure is the kernels', not the launching Python's."""

from __future__ import annotations

from collections.abc import Callable

import torch


def graph_time_us(fn: Callable[[int], object], calls: int, replays: int = 5) -> float:
    """Mean microseconds of one call, from a graph of fn(0) .. fn(calls - 1) back to back."""
    for index in range(min(calls, 2)):
        fn(index)  # compile and warm up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for index in range(calls):
            fn(index)
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / (replays * calls) * 1e3
