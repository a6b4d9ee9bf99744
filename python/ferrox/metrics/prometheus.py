"""Prometheus metrics for `/metrics`, named as vLLM's under a prefix: `ferrox:` by default, `vllm:` with
`ferrox serve --metrics-prefix vllm`, so a dashboard built for vLLM reads a ferrox server unchanged.

Every series carries `model_name` and `engine` (the engine core's index: "0" unless the server
runs data-parallel cores), as vLLM labels them, so a dashboard sums over `engine` for the server
and splits by it to see one core. Two sources:
- scheduler state and the cores' cumulative counters (generation tokens, prefix-cache queries and
  hits, preemptions) come from each core's stats snapshot (sent with outputs and whenever the core
  goes idle); a custom collector turns the latest snapshots into gauges / counters at scrape time,
  so the cores' own counters are the single truth;
- the multimodal processor cache's queries and hits (vLLM's mm_cache_queries / mm_cache_hits, in items) are
  the front-end's own (it prepares the images: multimodal/processor_cache.py), read from the cache at scrape
  time under engine "0"; always there, 0 without a cache, as vLLM registers them. Under
  --mm-processor-cache-type shm they stay that cache's: it decides what is processed again, while the
  shared-memory store (multimodal/shm_store.py) only carries the pixels to the cores;
- per-request counts and latencies are measured in the front-end (AsyncLLM hands each output
  batch's `IterationStats` here): prompt tokens (whole prompts, as vLLM counts them, and their
  cached part), finished requests by reason, and vLLM's request histograms.

Everything lives in a private CollectorRegistry (no process/platform collectors, no global
state), so several servers in one process (tests) do not collide.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from ferrox.metrics.batch_histogram import BatchHistogram
from ferrox.metrics.request_stats import IterationStats

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
# Tokens an engine step computed (vLLM's iteration_tokens_total buckets).
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
# Token-count histograms go up to this when the model's context length is not known yet.
DEFAULT_MAX_TOKENS_BUCKET = 1 << 20

LABELS = ["model_name", "engine"]
# The metric names' namespaces (`ferrox serve --metrics-prefix`): ferrox's own, or vLLM's for its dashboards.
METRIC_PREFIXES = ("ferrox", "vllm")

# (metric name without the prefix, stats key, help) for the cores' cumulative counters.
_CORE_COUNTERS = (
    ("prefix_cache_queries", "prefix_cache_queries", "Prefix cache queries, in tokens."),
    ("prefix_cache_hits", "prefix_cache_hits", "Prefix cache hits, in tokens."),
    ("generation_tokens", "num_generation_tokens", "Generation tokens processed."),
    ("num_preemptions", "num_preemptions", "Cumulative number of preemptions."),
)
# Speculative decoding (vLLM's spec_decode names), only for cores that speculate. Mean acceptance
# length = 1 + accepted / drafts; acceptance rate = accepted / draft tokens.
_SPEC_COUNTERS = (
    ("spec_decode_num_drafts", "spec_num_drafts", "Number of spec decoding drafts."),
    ("spec_decode_num_draft_tokens", "spec_num_draft_tokens", "Number of draft tokens."),
    ("spec_decode_num_accepted_tokens", "spec_num_accepted_tokens", "Number of accepted tokens."),
)
# The front-end's multimodal processor cache (vLLM's names; counted in items): (name, attribute, help).
_MM_CACHE_COUNTERS = (
    ("mm_cache_queries", "queries", "Multi-modal cache queries, in terms of number of queried items."),
    ("mm_cache_hits", "hits", "Multi-modal cache hits, in terms of number of cached items."),
)
# The prefix cache's host tier (--kv-offloading-size: vLLM's OffloadingConnector, whose hits vLLM counts as its
# KV connector's "external" prefix cache), only for cores that have one; in tokens, as the device cache's.
_HOST_TIER_COUNTERS = (
    ("external_prefix_cache_queries", "host_cache_queries",
     "External prefix cache queries from KV connector cross-instance cache sharing, in terms of number of "
     "queried tokens."),
    ("external_prefix_cache_hits", "host_cache_hits",
     "External prefix cache hits from KV connector cross-instance cache sharing, in terms of number of "
     "cached tokens."),
)
# Where a prefilled prompt's tokens came from (vLLM's prompt_tokens_by_source "source" label values).
PROMPT_SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")
_CORE_GAUGES = (
    ("num_requests_running", "num_running", "Requests in the running batch."),
    ("num_requests_waiting", "num_waiting", "Requests waiting to be scheduled."),
    ("kv_cache_usage_perc", "kv_cache_usage", "KV-cache usage. 1 means 100 percent usage."),
)


def per_engine_stats(stats: dict[str, Any]) -> list[dict[str, Any]]:
    """Each core's snapshot from the engine's stats (a single core's dict stands for itself)."""
    engines = stats.get("engines")
    return list(engines) if isinstance(engines, list) else [stats] if stats else []


def one_two_five_buckets(limit: int) -> tuple[float, ...]:
    """1, 2, 5, 10, 20, 50, ... up to `limit` (vLLM's buckets for token counts)."""
    buckets: list[float] = []
    exponent = 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > limit:
                return tuple(buckets)
            buckets.append(float(value))
        exponent += 1


class _CoreStatsCollector(Collector):
    def __init__(self, model_name: str, prefix: str) -> None:
        self.model_name = model_name
        self.prefix = prefix
        self.engines: list[dict[str, Any]] = []
        self.mm_cache: Any = None  # the front-end's ProcessorCache (its queries, hits), or None

    def collect(self):  # type: ignore[no-untyped-def]
        for metrics, family_type in ((_CORE_GAUGES, GaugeMetricFamily), (_CORE_COUNTERS, CounterMetricFamily)):
            for name, key, doc in metrics:
                family = family_type(f"{self.prefix}:{name}", doc, labels=LABELS)
                for index, stats in enumerate(self.engines):
                    family.add_metric([self.model_name, str(index)], float(stats.get(key, 0) or 0))
                yield family
        yield from self._host_tier_families()
        yield from self._mm_cache_families()
        yield from self._spec_families()
        yield from self._sleep_family()
        yield from self._cache_config_family()
        yield from self._lora_family()

    def _host_tier_families(self):  # type: ignore[no-untyped-def]
        if not any("host_cache_hits" in stats for stats in self.engines):
            return
        for name, key, doc in _HOST_TIER_COUNTERS:
            family = CounterMetricFamily(f"{self.prefix}:{name}", doc, labels=LABELS)
            for index, stats in enumerate(self.engines):
                family.add_metric([self.model_name, str(index)], float(stats.get(key, 0) or 0))
            yield family

    def _mm_cache_families(self):  # type: ignore[no-untyped-def]
        """One process prepares every image (the API server, or the offline LLM), whatever the number of cores:
        its counts are one series, engine "0"."""
        for name, attribute, doc in _MM_CACHE_COUNTERS:
            family = CounterMetricFamily(f"{self.prefix}:{name}", doc, labels=LABELS)
            family.add_metric([self.model_name, "0"], float(getattr(self.mm_cache, attribute, 0) or 0))
            yield family

    def _lora_family(self):  # type: ignore[no-untyped-def]
        """vLLM's lora_requests_info, for engines started with LoRA: the adapters of the running and of the
        waiting requests now (names, comma-separated, over every core) and max_lora as labels of one series
        whose value is the scrape's time, as vLLM sets it (LoRA-aware routers read the newest series)."""
        infos = [s["lora_info"] for s in self.engines if isinstance(s.get("lora_info"), dict)]
        if not infos:
            return
        family = GaugeMetricFamily(f"{self.prefix}:lora_requests_info", "Running stats on lora requests.",
                                   labels=["max_lora", "waiting_lora_adapters", "running_lora_adapters"])

        def names(key: str) -> str:
            return ",".join(dict.fromkeys(name for info in infos for name in info.get(key, ())))

        family.add_metric([str(infos[0].get("max_lora", 0)), names("waiting"), names("running")], time.time())
        yield family

    def _cache_config_family(self):  # type: ignore[no-untyped-def]
        """vLLM's cache_config_info: the KV cache's settings as labels of a constant 1, one series per core
        (dashboards read num_gpu_blocks from it)."""
        configs = [(i, s["cache_config"]) for i, s in enumerate(self.engines) if isinstance(s.get("cache_config"), dict)]
        if not configs:
            return
        keys = sorted(configs[0][1])
        family = GaugeMetricFamily(f"{self.prefix}:cache_config_info", "Information of the LLMEngine CacheConfig",
                                   labels=[*keys, "engine"])
        for index, config in configs:
            family.add_metric([str(config.get(k)) for k in keys] + [str(index)], 1.0)
        yield family

    def _sleep_family(self):  # type: ignore[no-untyped-def]
        """vLLM's engine_sleep_state, for engines started with sleep mode: one series per state, 1 for the
        engine's (awake; weights_offloaded: level 1's weights in host memory; discard_all: level 2's weights
        discarded, until reload_weights). Asleep with the weights in place (level 0, the KV cache alone):
        every series 0, as vLLM's."""
        sleepers = [(i, s) for i, s in enumerate(self.engines) if "is_sleeping" in s]
        if not sleepers:
            return
        family = GaugeMetricFamily(f"{self.prefix}:engine_sleep_state", "Engine sleep state; awake = 0 means the "
                                   "engine is sleeping; weights_offloaded = 1 means sleep level 1.",
                                   labels=[*LABELS, "sleep_state"])
        for index, stats in sleepers:
            states = {"awake": not stats["is_sleeping"], "weights_offloaded": bool(stats.get("weights_offloaded")),
                      "discard_all": bool(stats.get("discard_all"))}
            for state, on in states.items():
                family.add_metric([self.model_name, str(index), state], float(on))
        yield family

    def _spec_families(self):  # type: ignore[no-untyped-def]
        speculating = [(i, s) for i, s in enumerate(self.engines) if s.get("num_speculative_tokens")]
        if not speculating:
            return
        for name, key, doc in _SPEC_COUNTERS:
            family = CounterMetricFamily(f"{self.prefix}:{name}", doc, labels=LABELS)
            for index, stats in speculating:
                family.add_metric([self.model_name, str(index)], float(stats.get(key, 0) or 0))
            yield family
        per_pos = CounterMetricFamily(f"{self.prefix}:spec_decode_num_accepted_tokens_per_pos",
                                      "Accepted tokens per draft position.", labels=[*LABELS, "position"])
        for index, stats in speculating:
            for pos, count in enumerate(stats.get("spec_num_accepted_tokens_per_pos") or []):
                per_pos.add_metric([self.model_name, str(index), str(pos)], float(count))
        yield per_pos


@dataclass(slots=True)
class _EngineSeries:
    """The front-end's series of one engine core (label children resolved once)."""

    prompt_tokens: Any
    prompt_tokens_cached: Any
    prompt_tokens_by_source: dict[str, Any]
    ttft: Any
    itl: Any
    e2e: Any
    queue_time: Any
    prefill_time: Any
    decode_time: Any
    inference_time: Any
    time_per_output_token: Any
    iteration_tokens: Any
    params_n: Any
    params_max_tokens: Any
    request_prompt_tokens: Any
    request_generation_tokens: Any


class PrometheusStatLogger:
    """Implements ferrox.metrics.request_stats.StatLogger and renders the exposition text."""

    def __init__(self, model_name: str, *, max_model_len: int | None = None, prefix: str = "ferrox",
                 mm_cache: Any = None) -> None:
        """mm_cache: the front-end's multimodal processor cache (its `queries` and `hits`), or None."""
        if prefix not in METRIC_PREFIXES:
            raise ValueError(f"metrics_prefix: {prefix!r} is not one of {', '.join(METRIC_PREFIXES)}")
        self.registry = CollectorRegistry(auto_describe=True)
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.prefix = prefix
        self._core = _CoreStatsCollector(model_name, prefix)
        self._core.mm_cache = mm_cache
        self.registry.register(self._core)
        self._series: list[_EngineSeries] = []
        reg = self.registry

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, LABELS, buckets=buckets, registry=reg)

        self.request_success = Counter(
            f"{prefix}:request_success", "Count of finished requests, by finish reason.",
            [*LABELS, "finished_reason"], registry=reg,
        )
        self.prompt_tokens = Counter(
            f"{prefix}:prompt_tokens", "Prompt tokens of the requests prefilled (whole prompts, cached part included).",
            LABELS, registry=reg)
        self.prompt_tokens_cached = Counter(
            f"{prefix}:prompt_tokens_cached", "Prompt tokens found in the prefix cache (not computed).",
            LABELS, registry=reg)
        self.prompt_tokens_by_source = Counter(
            f"{prefix}:prompt_tokens_by_source", "Number of prompt tokens by source.", [*LABELS, "source"],
            registry=reg)
        self.ttft = histogram(f"{prefix}:time_to_first_token_seconds", "Time to first token in seconds.", TTFT_BUCKETS)
        # One observation per streamed token: fed a step at a time (metrics/batch_histogram.py).
        self.itl = BatchHistogram(f"{prefix}:inter_token_latency_seconds", "Inter-token latency in seconds.", LABELS,
                                  ITL_BUCKETS)
        reg.register(self.itl)
        self.e2e = histogram(f"{prefix}:e2e_request_latency_seconds", "End-to-end request latency in seconds.",
                             REQUEST_LATENCY_BUCKETS)
        self.queue_time = histogram(f"{prefix}:request_queue_time_seconds",
                                    "Time a request spent waiting before its first step, in seconds.",
                                    REQUEST_LATENCY_BUCKETS)
        self.prefill_time = histogram(f"{prefix}:request_prefill_time_seconds",
                                      "Time from a request's first step to its first token, in seconds.",
                                      REQUEST_LATENCY_BUCKETS)
        self.decode_time = histogram(f"{prefix}:request_decode_time_seconds",
                                     "Time from a request's first token to its last, in seconds.",
                                     REQUEST_LATENCY_BUCKETS)
        self.inference_time = histogram(f"{prefix}:request_inference_time_seconds",
                                        "Time a request spent running (prefill + decode), in seconds.",
                                        REQUEST_LATENCY_BUCKETS)
        self.time_per_output_token = histogram(f"{prefix}:request_time_per_output_token_seconds",
                                               "Mean time per output token after the first, per request, in seconds.",
                                               ITL_BUCKETS)
        self.params_n = histogram(f"{prefix}:request_params_n", "Histogram of the n request parameter.",
                                  (1, 2, 5, 10, 20))
        self.iteration_tokens = histogram(f"{prefix}:iteration_tokens_total", "Histogram of number of tokens per "
                                          "engine_step.", ITERATION_TOKEN_BUCKETS)
        self._request_prompt_tokens: Histogram | None = None
        self._request_params_max_tokens: Histogram | None = None
        self._request_generation_tokens: Histogram | None = None

    # ---- StatLogger -------------------------------------------------------------------------------
    def on_scheduler_stats(self, stats: dict[str, Any]) -> None:
        engines = per_engine_stats(stats)
        self._core.engines = engines
        if self.max_model_len is None and stats.get("max_model_len"):
            self.max_model_len = int(stats["max_model_len"])
        # Every core's series exist from the first scrape on, at 0, not from its first request.
        if engines:
            self._engine(len(engines) - 1)

    def on_iteration(self, stats: IterationStats) -> None:
        series = self._engine(stats.engine)
        if stats.num_prompt_tokens or stats.num_generation_tokens:
            series.iteration_tokens.observe(stats.num_prompt_tokens + stats.num_generation_tokens)
        if stats.num_prompt_tokens:
            series.prompt_tokens.inc(stats.num_prompt_tokens)
        if stats.num_cached_tokens:
            series.prompt_tokens_cached.inc(stats.num_cached_tokens)
        if stats.num_prompt_tokens:
            external = stats.num_external_cached_tokens
            by_source = series.prompt_tokens_by_source
            by_source["local_compute"].inc(stats.num_prompt_tokens - stats.num_cached_tokens)
            by_source["local_cache_hit"].inc(stats.num_cached_tokens - external)
            by_source["external_kv_transfer"].inc(external)
        for ttft in stats.time_to_first_tokens:
            series.ttft.observe(ttft)
        if stats.inter_token_latencies:
            per_token, counts = zip(*stats.inter_token_latencies, strict=True)
            self.itl.observe_many(series.itl, per_token, counts)
        for done in stats.finished:
            self.request_success.labels(self.model_name, str(stats.engine), done.finish_reason).inc()
            series.e2e.observe(done.e2e_latency)
            series.request_prompt_tokens.observe(done.num_prompt_tokens)
            series.request_generation_tokens.observe(done.num_generation_tokens)
            series.params_n.observe(done.n)
            if done.max_tokens is not None:
                series.params_max_tokens.observe(done.max_tokens)
            for histogram, value in ((series.queue_time, done.queue_time), (series.prefill_time, done.prefill_time),
                                     (series.decode_time, done.decode_time),
                                     (series.inference_time, done.inference_time),
                                     (series.time_per_output_token, done.time_per_output_token)):
                if value is not None:
                    histogram.observe(value)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    # ---- per-engine series ----------------------------------------------------------------------------
    def _engine(self, engine: int) -> _EngineSeries:
        while len(self._series) <= engine:
            label = (self.model_name, str(len(self._series)))
            self.itl.ensure(label)
            prompt_hist, generation_hist = self._token_histograms()
            self._series.append(_EngineSeries(
                prompt_tokens=self.prompt_tokens.labels(*label),
                prompt_tokens_cached=self.prompt_tokens_cached.labels(*label),
                prompt_tokens_by_source={source: self.prompt_tokens_by_source.labels(*label, source)
                                         for source in PROMPT_SOURCES},
                ttft=self.ttft.labels(*label),
                itl=label,
                e2e=self.e2e.labels(*label),
                queue_time=self.queue_time.labels(*label),
                prefill_time=self.prefill_time.labels(*label),
                decode_time=self.decode_time.labels(*label),
                inference_time=self.inference_time.labels(*label),
                time_per_output_token=self.time_per_output_token.labels(*label),
                iteration_tokens=self.iteration_tokens.labels(*label),
                params_n=self.params_n.labels(*label),
                params_max_tokens=self._params_max_tokens().labels(*label),
                request_prompt_tokens=prompt_hist.labels(*label),
                request_generation_tokens=generation_hist.labels(*label),
            ))
        return self._series[engine]

    def _params_max_tokens(self) -> Histogram:
        """Created on first use, with the token histograms' buckets (the context length is known by then)."""
        if self._request_params_max_tokens is None:
            self._request_params_max_tokens = Histogram(
                f"{self.prefix}:request_params_max_tokens", "Histogram of the max_tokens request parameter.", LABELS,
                buckets=one_two_five_buckets(self.max_model_len or DEFAULT_MAX_TOKENS_BUCKET), registry=self.registry)
        return self._request_params_max_tokens

    def _token_histograms(self) -> tuple[Histogram, Histogram]:
        """Created on first use, once the context length (the largest useful bucket) is known."""
        if self._request_prompt_tokens is None or self._request_generation_tokens is None:
            buckets = one_two_five_buckets(self.max_model_len or DEFAULT_MAX_TOKENS_BUCKET)
            self._request_prompt_tokens = Histogram(
                f"{self.prefix}:request_prompt_tokens", "Prompt tokens per finished request.", LABELS,
                buckets=buckets, registry=self.registry)
            self._request_generation_tokens = Histogram(
                f"{self.prefix}:request_generation_tokens", "Generation tokens per finished request.", LABELS,
                buckets=buckets, registry=self.registry)
        return self._request_prompt_tokens, self._request_generation_tokens
