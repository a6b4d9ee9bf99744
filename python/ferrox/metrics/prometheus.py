"""Prometheus metrics for `/metrics`, named like vLLM's (`vllm:` -> `ferrox:`) so dashboards port.

Two sources:
- scheduler state and cumulative counters come from the engine core's stats snapshot (sent
  with outputs and whenever the core goes idle); a custom collector turns the latest snapshot
  into gauges / counters at scrape time, so the core's own counters are the single truth;
- latency histograms and finished-request counts are measured in the front-end (AsyncLLM
  calls the `StatLogger` methods below as outputs arrive).

Everything lives in a private CollectorRegistry (no process/platform collectors, no global
state), so several servers in one process (tests) do not collide.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from ferrox.outputs import RequestMetrics

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# The `*_created` timestamp series double the scrape size and no dashboard reads them (vLLM drops
# them too). This is a process-wide prometheus_client switch.
disable_created_metrics()

# Buckets as vLLM uses them, so percentiles from ported dashboards mean the same.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                           120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)

# (metric name, stats key, help) for the core's cumulative counters.
_CORE_COUNTERS = (
    ("ferrox:prefix_cache_queries", "prefix_cache_queries", "Prefix cache queries, in tokens."),
    ("ferrox:prefix_cache_hits", "prefix_cache_hits", "Prefix cache hits, in tokens."),
    ("ferrox:prompt_tokens", "num_prompt_tokens", "Prefill tokens processed."),
    ("ferrox:generation_tokens", "num_generation_tokens", "Generation tokens processed."),
    ("ferrox:num_preemptions", "num_preemptions", "Cumulative number of preemptions."),
)
_CORE_GAUGES = (
    ("ferrox:num_requests_running", "num_running", "Requests in the running batch."),
    ("ferrox:num_requests_waiting", "num_waiting", "Requests waiting to be scheduled."),
    ("ferrox:kv_cache_usage_perc", "kv_cache_usage", "KV-cache usage. 1 means 100 percent usage."),
)


class _CoreStatsCollector(Collector):
    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.stats: dict[str, Any] = {}

    def collect(self):  # type: ignore[no-untyped-def]
        for name, key, doc in _CORE_GAUGES:
            family = GaugeMetricFamily(name, doc, labels=["model_name"])
            family.add_metric([self.model_name], float(self.stats.get(key, 0) or 0))
            yield family
        for name, key, doc in _CORE_COUNTERS:
            family = CounterMetricFamily(name, doc, labels=["model_name"])
            family.add_metric([self.model_name], float(self.stats.get(key, 0) or 0))
            yield family


class PrometheusStatLogger:
    """Implements ferrox.engine.async_llm.StatLogger and renders the exposition text."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.model_name = model_name
        self._core = _CoreStatsCollector(model_name)
        self.registry.register(self._core)
        labels = ["model_name"]
        self.request_success = Counter(
            "ferrox:request_success", "Count of finished requests, by finish reason.",
            ["model_name", "finished_reason"], registry=self.registry,
        )
        self.ttft = Histogram(
            "ferrox:time_to_first_token_seconds", "Time to first token in seconds.",
            labels, buckets=TTFT_BUCKETS, registry=self.registry,
        ).labels(model_name)
        self.itl = Histogram(
            "ferrox:inter_token_latency_seconds", "Inter-token latency in seconds.",
            labels, buckets=ITL_BUCKETS, registry=self.registry,
        ).labels(model_name)
        self.e2e = Histogram(
            "ferrox:e2e_request_latency_seconds", "End-to-end request latency in seconds.",
            labels, buckets=REQUEST_LATENCY_BUCKETS, registry=self.registry,
        ).labels(model_name)
        self.queue_time = Histogram(
            "ferrox:request_queue_time_seconds", "Time a request spent waiting before its first step.",
            labels, buckets=REQUEST_LATENCY_BUCKETS, registry=self.registry,
        ).labels(model_name)

    # ---- StatLogger -------------------------------------------------------------------------------
    def on_scheduler_stats(self, stats: dict[str, Any]) -> None:
        self._core.stats = stats

    def on_tokens(self, num_tokens: int, ttft: float | None, itl: float | None, queue_time: float | None) -> None:
        if ttft is not None:
            self.ttft.observe(ttft)
        if queue_time is not None:
            self.queue_time.observe(queue_time)
        if itl is not None:
            # Several tokens in one output (e.g. after a stall) share the gap evenly.
            per_token = itl / max(1, num_tokens)
            for _ in range(num_tokens):
                self.itl.observe(per_token)

    def on_request_finished(self, finish_reason: str, metrics: RequestMetrics) -> None:
        self.request_success.labels(self.model_name, finish_reason).inc()
        if metrics.finished_time is not None:
            self.e2e.observe(max(0.0, metrics.finished_time - metrics.arrival_time))

    def render(self) -> bytes:
        return generate_latest(self.registry)
