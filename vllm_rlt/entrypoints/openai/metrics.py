"""Prometheus metrics of the server, including the looped-model figures (exit depths,
loops per token, passes per second, rows per pass).

Request figures (latencies, tokens, exit depths) are counted by the frontend that served
the request, on its event loop. Engine figures (requests running and waiting, KV usage,
passes and their rate) are the core's own counters, read over its control channel when
/metrics is scraped. With several API servers, each counts its requests in prometheus'
multiprocess files and every scrape sums them all."""

from __future__ import annotations

import os
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.multiprocess import MultiProcessCollector

from vllm_rlt.engine.core_outputs import CoreStats
from vllm_rlt.engine.process.messages import EngineOutputs
from vllm_rlt.engine.process.pass_rate import RATE_WINDOW_S
from vllm_rlt.outputs import RequestOutput

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
EXIT_DEPTH = "vllm_rlt:exit_depth"


# Ours -> vLLM's name for the same figure: routers (gateway-api-inference-extension, vLLM's
# production stack) and Grafana dashboards read these, with a model_name label.
VLLM_NAMES = {
    "vllm_rlt:num_requests_running": "vllm:num_requests_running",
    "vllm_rlt:num_requests_waiting": "vllm:num_requests_waiting",
    "vllm_rlt:kv_cache_usage_perc": "vllm:kv_cache_usage_perc",
    "vllm_rlt:prompt_tokens": "vllm:prompt_tokens",
    "vllm_rlt:generation_tokens": "vllm:generation_tokens",
    "vllm_rlt:request_success": "vllm:request_success",
    "vllm_rlt:time_to_first_token_seconds": "vllm:time_to_first_token_seconds",
    "vllm_rlt:time_per_output_token_seconds": "vllm:time_per_output_token_seconds",
    "vllm_rlt:e2e_request_latency_seconds": "vllm:e2e_request_latency_seconds",
    "vllm_rlt:num_preemptions": "vllm:num_preemptions",
    "vllm_rlt:prefix_cache_queries": "vllm:prefix_cache_queries",
    "vllm_rlt:prefix_cache_hits": "vllm:prefix_cache_hits",
    "vllm_rlt:spec_decode_num_drafts": "vllm:spec_decode_num_drafts",
    "vllm_rlt:spec_decode_num_draft_tokens": "vllm:spec_decode_num_draft_tokens",
    "vllm_rlt:spec_decode_num_accepted_tokens": "vllm:spec_decode_num_accepted_tokens",
    "vllm_rlt:spec_decode_num_accepted_tokens_per_pos": (
        "vllm:spec_decode_num_accepted_tokens_per_pos"
    ),
}


class ServerMetrics:
    def __init__(self, num_loops: int, model_name: str = "", api_server: int = 1) -> None:
        self.model_name = model_name
        self.api_server = str(api_server)  # which of `--api-server-count` servers this is
        self.registry = CollectorRegistry()
        r = self.registry
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
        # How evenly the kernel spreads connections over several API servers.
        self.api_server_requests = Counter(
            "vllm_rlt:api_server_requests",
            "Finished requests by the API server (1 to --api-server-count) that served them",
            ["api_server"],
            registry=r,
        )
        self.exit_depth = Histogram(
            EXIT_DEPTH,
            "Loops each decode token ran",
            buckets=tuple(range(1, num_loops + 1)),
            registry=r,
        )
        # Prefill/decode disaggregation (serve --disaggregate): requests handed over.
        self.kv_handovers = Counter(
            "vllm_rlt:kv_transfer_handovers",
            "Requests a prefill core handed to a decode core",
            registry=r,
        )
        self.kv_bytes = Counter(
            "vllm_rlt:kv_transfer_bytes", "K/V bytes handed to decode cores", registry=r
        )
        self.kv_seconds = Histogram(
            "vllm_rlt:kv_transfer_seconds",
            "From a prefill core's offer to the decode core holding its copy of the K/V",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.kv_prefetched_blocks = Counter(
            "vllm_rlt:kv_transfer_prefetched_blocks",
            "Prompt blocks lent to a decode core while the prompt's later chunks still ran",
            registry=r,
        )
        self.kv_queue = Gauge(
            "vllm_rlt:kv_transfer_queue",
            "Handovers offered and not yet copied by their decode core",
            registry=r,
            multiprocess_mode="livesum",
        )
        self._offered: dict[str, tuple[float, int]] = {}  # request id -> (when, bytes)

    def render(self, engine: CoreStats | None) -> bytes:
        """The scrape: every API server's request figures and the core's counters
        (`engine`, the core's answer to "stats"; None when it could not answer)."""
        directory = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
        if directory:
            summed = CollectorRegistry()
            MultiProcessCollector(summed, directory)
            families = list(summed.collect())
        else:
            families = list(self.registry.collect())
        families.extend(_mean_loops(families))
        if engine is not None:
            families.extend(_engine_families(engine.per_core or [engine]))
        families.extend(_vllm_aliases(families, self.model_name))
        return generate_latest(_Families(families))

    def observe_step(self, outputs: EngineOutputs) -> None:
        """One engine step: the exit depth of every new decode token."""
        tokens = 0
        for delta in outputs.requests:
            for completion in delta.completions:
                tokens += len(completion.token_ids)
                # A completion's first token comes from the prefill, at full depth: it is
                # no decode token.
                skip = 1 if completion.start == 0 else 0
                for depth in completion.exit_depths[skip:]:
                    self.exit_depth.observe(depth)
        if tokens:
            self.generation_tokens.inc(tokens)
        if outputs.offers or outputs.imported:
            self._observe_handovers(outputs)
        for prefetch in outputs.prefetches:
            self.kv_prefetched_blocks.inc(len(prefetch.blocks))

    def _observe_handovers(self, outputs: EngineOutputs) -> None:
        now = time.monotonic()
        for offer in outputs.offers:
            moved = sum(c.kv.nbytes for c in offer.completions if c.kv is not None)
            self._offered[offer.request_id] = (now, moved)
        for request_id in outputs.imported:
            offered = self._offered.pop(request_id, None)
            if offered is not None:
                self.kv_handovers.inc()
                self.kv_bytes.inc(offered[1])
                self.kv_seconds.observe(now - offered[0])
        self.kv_queue.set(len(self._offered))

    def observe_finished(self, output: RequestOutput) -> None:
        if self._offered.pop(output.request_id, None) is not None:  # never copied
            self.kv_queue.set(len(self._offered))
        metrics = output.metrics
        tokens = sum(len(c.token_ids) for c in output.outputs)
        self.prompt_tokens.inc(len(output.prompt_token_ids))
        self.api_server_requests.labels(self.api_server).inc()
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


class _Families:
    """Collected families, in the shape `generate_latest` reads."""

    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> list[Metric]:
        return self.families


def _mean_loops(families: list[Metric]) -> list[Metric]:
    """Mean loops per decode token, from the exit-depth histogram's sum and count."""
    total = count = 0.0
    for family in families:
        if family.name == EXIT_DEPTH:
            for sample in family.samples:
                if sample.name == EXIT_DEPTH + "_sum":
                    total += sample.value
                elif sample.name == EXIT_DEPTH + "_count":
                    count += sample.value
    if not count:
        return []
    gauge = GaugeMetricFamily("vllm_rlt:mean_loops_per_token", "Mean loops per decode token")
    gauge.add_metric([], total / count)
    return [gauge]


def _engine_families(engines: list[CoreStats | None]) -> list[Metric]:
    """The cores' counters, one sample per core labelled `engine` (its data-parallel rank;
    "0" with one core), as vLLM labels them: sum by engine for the server's total. A core
    that is gone (None) has no samples."""
    labels = ["engine"]

    def family(kind, name: str, documentation: str, value) -> Metric:
        metric = kind(name, documentation, labels=labels)
        for rank, stats in enumerate(engines):
            if stats is not None:
                metric.add_metric([str(rank)], value(stats))
        return metric

    window = f"over the last {RATE_WINDOW_S:g} s"
    gauges = (
        ("vllm_rlt:num_requests_running", "Requests in a slot", "num_running"),
        ("vllm_rlt:num_requests_waiting", "Requests not yet admitted", "num_waiting"),
        ("vllm_rlt:num_free_blocks", "KV blocks free (cached ones included)", "num_free_blocks"),
        ("vllm_rlt:num_cached_blocks", "KV blocks in the prefix cache", "num_cached_blocks"),
        ("vllm_rlt:passes_per_second", f"Passes per second {window}", "passes_per_second"),
        ("vllm_rlt:rows_per_pass", f"Mean rows per pass {window}", "rows_per_pass"),
    )
    counters = (
        ("vllm_rlt:passes", "Passes over the layer stack", "num_passes"),
        (
            "vllm_rlt:decode_graph_passes",
            "Passes that replayed a decode CUDA graph",
            "num_decode_graph_passes",
        ),
        (
            "vllm_rlt:prompt_graph_passes",
            "Passes with prompt rows that replayed the prompt-pass CUDA graphs",
            "num_prompt_graph_passes",
        ),
        ("vllm_rlt:num_preemptions", "Requests preempted to free KV blocks", "num_preemptions"),
        (
            "vllm_rlt:prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache",
            "prefix_cache_queries",
        ),
        (
            "vllm_rlt:prefix_cache_hits",
            "Prompt tokens found in the prefix cache",
            "prefix_cache_hits",
        ),
        (
            "vllm_rlt:spec_decode_num_drafts",
            "Self-speculative drafts verified (each draft is verified on its own)",
            "spec_num_drafts",
        ),
        ("vllm_rlt:spec_decode_num_draft_tokens", "Draft tokens verified", "spec_num_draft_tokens"),
        (
            "vllm_rlt:spec_decode_num_accepted_tokens",
            "Draft tokens accepted",
            "spec_num_accepted_tokens",
        ),
    )
    families = [
        family(GaugeMetricFamily, name, doc, lambda s, k=key: getattr(s, k))
        for name, doc, key in gauges
    ]
    families.append(
        family(
            GaugeMetricFamily,
            "vllm_rlt:kv_cache_usage_perc",
            "Fraction of KV blocks held",
            lambda s: 1.0 - s.num_free_blocks / max(s.num_blocks, 1),
        )
    )
    families += [
        family(CounterMetricFamily, name, doc, lambda s, k=key: getattr(s, k))
        for name, doc, key in counters
    ]
    families.append(_per_position(engines))
    return families


def _per_position(engines: list[CoreStats | None]) -> CounterMetricFamily:
    family = CounterMetricFamily(
        "vllm_rlt:spec_decode_num_accepted_tokens_per_pos",
        "Accepted draft tokens by how far ahead of the verified token they were made "
        "(0 = the next one)",
        labels=["engine", "position"],
    )
    for rank, stats in enumerate(engines):
        for position, count in enumerate(stats.spec_accepted_per_position if stats else ()):
            family.add_metric([str(rank), str(position)], count)
    return family


def _vllm_aliases(families: list[Metric], model_name: str) -> list[Metric]:
    """A copy of every family vLLM also has, under vLLM's name, each sample labelled with
    the served model's name."""
    aliases = []
    for family in families:
        name = VLLM_NAMES.get(family.name)
        if name is None:
            continue
        alias = Metric(name, family.documentation, family.type)
        for sample in family.samples:
            alias.add_sample(
                name + sample.name[len(family.name) :],
                {**sample.labels, "model_name": model_name},
                sample.value,
                sample.timestamp,
                sample.exemplar,
            )
        aliases.append(alias)
    return aliases
