"""BatchHistogram (a step's observations at once) exposes what prometheus_client's Histogram does."""

from __future__ import annotations

import random

import pytest
from ferrox.metrics.batch_histogram import BatchHistogram
from ferrox.metrics.prometheus import ITL_BUCKETS, LABELS
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families


def _samples(registry: CollectorRegistry) -> dict[tuple, float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(generate_latest(registry).decode())
            for s in family.samples}


def test_same_exposition_as_a_histogram():
    rng = random.Random(0)
    reference, batched = CollectorRegistry(), CollectorRegistry()
    name, doc = "ferrox:inter_token_latency_seconds", "Inter-token latency in seconds."
    hist = Histogram(name, doc, LABELS, buckets=ITL_BUCKETS, registry=reference)
    batch = BatchHistogram(name, doc, LABELS, ITL_BUCKETS)
    batched.register(batch)
    hist.labels("m", "1")  # an engine with no observations yet is exposed at zero
    batch.ensure(("m", "1"))
    for _step in range(5):
        # Values on bucket bounds (le is inclusive), zero, past the last bound, and weighted ones.
        values = [rng.choice([0.0, 0.01, 0.025, 0.3, 80.0, 100.0]) if rng.random() < 0.3 else rng.expovariate(20)
                  for _ in range(200)]
        weights = [rng.randint(1, 3) for _ in values]
        for value, weight in zip(values, weights, strict=True):
            for _ in range(weight):
                hist.labels("m", "0").observe(value)
        batch.observe_many(("m", "0"), values, weights)
    batch.observe_many(("m", "0"), [])  # an empty step changes nothing
    expected, got = _samples(reference), _samples(batched)
    assert expected.keys() == got.keys()
    for key, value in expected.items():
        assert got[key] == pytest.approx(value, rel=1e-12), key
    assert got[("ferrox:inter_token_latency_seconds_count", (("engine", "0"), ("model_name", "m")))] > 1000
