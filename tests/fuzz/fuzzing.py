"""Shared settings of the property-based fuzzers (hypothesis; each test module importorskips it).

Each fuzzer runs a bounded number of cases in CI; FERROX_FUZZ_EXAMPLES=N runs N per fuzzer (the
longer mode: e.g. FERROX_FUZZ_EXAMPLES=5000 pytest tests/fuzz). No example database is written
(CI clones are fresh, and a stale database would replay cases from another version).
"""

from __future__ import annotations

import os

import hypothesis


def fuzz_settings(ci_default: int) -> hypothesis.settings:
    """`ci_default` cases unless FERROX_FUZZ_EXAMPLES says otherwise; no per-example deadline (the
    2-core CI box is shared and slow) and no health check on slow data generation. CI runs are
    derandomized (the same cases every run, so a red CI is reproducible and a known bug's xfail test
    stays strict); the longer mode draws new cases each run."""
    longer = os.environ.get("FERROX_FUZZ_EXAMPLES")
    return hypothesis.settings(max_examples=int(longer or ci_default), deadline=None, database=None,
                               derandomize=longer is None, suppress_health_check=list(hypothesis.HealthCheck))
