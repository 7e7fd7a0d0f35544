"""Prometheus metrics of the server, including the looped-model figures (exit depths,
loops per token, passes per second, rows per pass). Engine steps are observed on the
frontend's event loop, as are finished requests; the engine core itself
only counts."""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from vllm_rlt.engine.messages import EngineOutputs
from vllm_rlt.outputs import RequestOutput

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
RATE_WINDOW_S = 5.0


class PassRate:
    """Passes per second and rows per pass over the last `window` seconds, read at scrape
    time (so an idle engine reads 0 passes per second, not its last busy rate)."""

    def __init__(
        self, window: float = RATE_WINDOW_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.window = window
        self.clock = clock
        self._lock = threading.Lock()
        # (time, passes, rows): cumulative engine counters; the first is the window's base.
        self._samples: deque[tuple[float, int, int]] = deque([(clock(), 0, 0)])

    def record(self, passes: int, rows: int) -> None:
        now = self.clock()
        with self._lock:
            self._samples.append((now, passes, rows))
            # Keep one sample at or before the window's start as the base.
            while len(self._samples) > 1 and self._samples[1][0] <= now - self.window:
                self._samples.popleft()

    def _span(self) -> tuple[float, int, int]:
        """(seconds, passes, rows) over the window ending now."""
        now = self.clock()
        with self._lock:
            start, passes0, rows0 = self._samples[0]
            _, passes1, rows1 = self._samples[-1]
        return max(now - start, 1e-9), passes1 - passes0, rows1 - rows0

    def passes_per_second(self) -> float:
        seconds, passes, _ = self._span()
        return passes / seconds

    def rows_per_pass(self) -> float:
        _, passes, rows = self._span()
        return rows / passes if passes else 0.0


class ServerMetrics:
    def __init__(self, num_loops: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.running = Gauge("vllm_rlt:num_requests_running", "Requests in a slot", registry=r)
        self.waiting = Gauge(
            "vllm_rlt:num_requests_waiting", "Requests not yet admitted", registry=r
        )
        self.kv_usage = Gauge(
            "vllm_rlt:kv_cache_usage_perc", "Fraction of KV blocks held", registry=r
        )
        self.ttft = Histogram(
            "vllm_rlt:time_to_first_token_seconds",
            "Time to first token",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            "vllm_rlt:time_per_output_token_seconds",
            "Mean time per output token after the first",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "vllm_rlt:e2e_request_latency_seconds",
            "Request latency",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter("vllm_rlt:prompt_tokens", "Prompt tokens", registry=r)
        self.generation_tokens = Counter(
            "vllm_rlt:generation_tokens", "Generated tokens", registry=r
        )
        self.request_success = Counter(
            "vllm_rlt:request_success",
            "Finished requests by finish reason",
            ["finished_reason"],
            registry=r,
        )
        self.exit_depth = Histogram(
            "vllm_rlt:exit_depth",
            "Loops each decode token ran",
            buckets=tuple(range(1, num_loops + 1)),
            registry=r,
        )
        self.mean_loops = Gauge(
            "vllm_rlt:mean_loops_per_token", "Mean loops per decode token", registry=r
        )
        self.passes = Counter("vllm_rlt:passes", "Passes over the layer stack", registry=r)
        self.preemptions = Counter(
            "vllm_rlt:num_preemptions", "Requests preempted to free KV blocks", registry=r
        )
        self.rate = PassRate(clock=clock)
        Gauge(
            "vllm_rlt:passes_per_second",
            f"Passes per second over the last {RATE_WINDOW_S:g} s",
            registry=r,
        ).set_function(self.rate.passes_per_second)
        Gauge(
            "vllm_rlt:rows_per_pass",
            f"Mean rows per pass over the last {RATE_WINDOW_S:g} s",
            registry=r,
        ).set_function(self.rate.rows_per_pass)
        self._counted = (0, 0)  # (passes, preemptions) already added to the counters
        self._depth_sum = 0
        self._depth_count = 0

    def observe_step(self, outputs: EngineOutputs) -> None:
        """One engine step: its counters, and the exit depth of every new decode token."""
        stats = outputs.stats
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.kv_usage.set(1.0 - stats.num_free_blocks / max(stats.num_blocks, 1))
        passes, preemptions = self._counted
        if stats.num_passes > passes:
            self.passes.inc(stats.num_passes - passes)
        if stats.num_preemptions > preemptions:
            self.preemptions.inc(stats.num_preemptions - preemptions)
        self._counted = (stats.num_passes, stats.num_preemptions)
        self.rate.record(stats.num_passes, stats.num_rows)
        tokens = 0
        for delta in outputs.requests:
            for completion in delta.completions:
                tokens += len(completion.token_ids)
                # A completion's first token comes from the prefill, at full depth: it is
                # no decode token.
                skip = 1 if completion.start == 0 else 0
                for depth in completion.exit_depths[skip:]:
                    self.exit_depth.observe(depth)
                    self._depth_sum += depth
                    self._depth_count += 1
        if tokens:
            self.generation_tokens.inc(tokens)
        if self._depth_count:
            self.mean_loops.set(self._depth_sum / self._depth_count)

    def observe_finished(self, output: RequestOutput) -> None:
        metrics = output.metrics
        tokens = sum(len(c.token_ids) for c in output.outputs)
        self.prompt_tokens.inc(len(output.prompt_token_ids))
        for completion in output.outputs:
            self.request_success.labels(completion.finish_reason or "abort").inc()
        if metrics.time_to_first_token is not None:
            self.ttft.observe(metrics.time_to_first_token)
        if metrics.finished_time is not None:
            self.e2e.observe(metrics.finished_time - metrics.arrival_time)
            if metrics.first_token_time is not None and tokens > len(output.outputs):
                per_token = (metrics.finished_time - metrics.first_token_time) / (
                    tokens - len(output.outputs)
                )
                self.tpot.observe(per_token)
