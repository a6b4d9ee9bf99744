"""In-memory Prometheus metrics as Python objects: what `LLM.get_metrics()` returns (vLLM's
vllm.v1.metrics.reader API: the same classes and fields, so code written against vLLM's reads ferrox's).

Each series of a family becomes one object: a Counter or Gauge with its value, a Histogram with its
buckets (upper bound as Prometheus writes it -> cumulative count; "+Inf" always there), count and sum,
and a Vector for the one counter family whose series are positions of an array (accepted speculative
tokens per draft position). Only the families under `prefix:` are read; summaries, info and other
types are skipped.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry

PER_POSITION = "spec_decode_num_accepted_tokens_per_pos"


@dataclass
class Metric:
    name: str
    labels: dict[str, str]


@dataclass
class Counter(Metric):
    value: int


@dataclass
class Gauge(Metric):
    value: float


@dataclass
class Vector(Metric):
    """Counters indexed by their `position` label, as one list."""

    values: list[int]


@dataclass
class Histogram(Metric):
    count: int
    sum: float
    buckets: dict[str, int]  # cumulative, keyed by the `le` label ("+Inf" included)


def _key(labels: dict[str, str], drop: str | None = None) -> tuple[tuple[str, str], ...]:
    return tuple(sorted((k, v) for k, v in labels.items() if k != drop))


def snapshot(registry: CollectorRegistry, prefix: str = "vllm") -> list[Metric]:
    """Every series of the registry's `prefix:` families, in collection order."""
    out: list[Metric] = []
    for family in registry.collect():
        if not family.name.startswith(prefix + ":"):
            continue
        if family.type == "gauge":
            out += [Gauge(family.name, dict(s.labels), float(s.value)) for s in family.samples if s.name == family.name]
        elif family.type == "counter":
            samples = [s for s in family.samples if s.name == family.name + "_total"]
            if family.name.endswith(":" + PER_POSITION):
                by_series: dict[tuple[tuple[str, str], ...], dict[int, int]] = defaultdict(dict)
                for s in samples:
                    by_series[_key(s.labels, "position")][int(s.labels["position"])] = int(s.value)
                for key, values in by_series.items():
                    out.append(Vector(family.name, dict(key), [values.get(i, 0) for i in range(max(values) + 1)]))
            else:
                out += [Counter(family.name, dict(s.labels), int(s.value)) for s in samples]
        elif family.type == "histogram":
            series: dict[tuple[tuple[str, str], ...], dict[str, Any]] = defaultdict(lambda: {"buckets": {}})
            for s in family.samples:
                if s.name == family.name + "_bucket":
                    series[_key(s.labels, "le")]["buckets"][s.labels["le"]] = int(s.value)
                elif s.name == family.name + "_count":
                    series[_key(s.labels)]["count"] = int(s.value)
                elif s.name == family.name + "_sum":
                    series[_key(s.labels)]["sum"] = float(s.value)
            for key, parts in series.items():
                out.append(Histogram(family.name, dict(key), parts.get("count", 0), parts.get("sum", 0.0),
                                     parts["buckets"]))
    return out
