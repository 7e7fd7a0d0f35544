"""Prometheus metrics of the server, including the looped-model figures (exit depths,
loops per token, passes per second, rows per pass). Updated from the engine thread."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from vllm_rlt.engine.engine_core import EngineCore
from vllm_rlt.outputs import RequestOutput

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class ServerMetrics:
    def __init__(self, num_loops: int) -> None:
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
        self.passes_per_second = Gauge("vllm_rlt:passes_per_second", "Recent pass rate", registry=r)
        self.rows_per_pass = Gauge(
            "vllm_rlt:rows_per_pass", "Mean rows per pass, recent", registry=r
        )
        self._seen: dict[str, list[int]] = {}
        self._depth_sum = 0
        self._depth_count = 0
        self._window = (time.monotonic(), 0, 0)  # (time, passes, rows) at the window start

    def on_step(self, engine: EngineCore, outputs: list[RequestOutput]) -> None:
        scheduler = engine.scheduler
        self.running.set(len(scheduler.running))
        self.waiting.set(len(scheduler.waiting))
        self.kv_usage.set(1.0 - engine.kv.num_free_blocks / max(engine.kv.num_blocks, 1))
        now = time.monotonic()
        start, passes, rows = self._window
        new_passes = engine.num_passes - passes
        if new_passes:
            self.passes.inc(new_passes)
            self._window = (start, engine.num_passes, rows)
        if now - start >= 1.0:
            done = engine.num_passes - passes
            self.passes_per_second.set(done / (now - start))
            if done:
                self.rows_per_pass.set((engine.num_rows_total - rows) / done)
            self._window = (now, engine.num_passes, engine.num_rows_total)
        for output in outputs:
            self._observe(output)

    def _observe(self, output: RequestOutput) -> None:
        seen = self._seen.setdefault(output.request_id, [0] * len(output.outputs))
        for index, completion in enumerate(output.outputs):
            for depth in completion.exit_depths[max(seen[index], 1) :]:
                self.exit_depth.observe(depth)
                self._depth_sum += depth
                self._depth_count += 1
            seen[index] = len(completion.exit_depths)
        if self._depth_count:
            self.mean_loops.set(self._depth_sum / self._depth_count)
        if not output.finished:
            return
        del self._seen[output.request_id]
        metrics = output.metrics
        tokens = sum(len(c.token_ids) for c in output.outputs)
        self.prompt_tokens.inc(len(output.prompt_token_ids))
        self.generation_tokens.inc(tokens)
        if metrics.time_to_first_token is not None:
            self.ttft.observe(metrics.time_to_first_token)
        if metrics.finished_time is not None:
            self.e2e.observe(metrics.finished_time - metrics.arrival_time)
            if metrics.first_token_time is not None and tokens > len(output.outputs):
                per_token = (metrics.finished_time - metrics.first_token_time) / (
                    tokens - len(output.outputs)
                )
                self.tpot.observe(per_token)
