"""GET /status: what the page's live view shows, as JSON (also handy from curl).

The engine core's stats snapshot holds gauges (running, waiting, KV usage) and cumulative
token counters; throughput is the counters' rise over the last few seconds, measured here
between calls so that the page and a shell loop see the same numbers.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

import ferrox

# Throughput is averaged over about this window (the page polls every second).
WINDOW_S = 5.0


class ThroughputMeter:
    """Token counters sampled per call; rate = rise over the window."""

    def __init__(self) -> None:
        self.started = time.monotonic()
        self._samples: deque[tuple[float, float, float]] = deque()

    def rates(self, prompt_total: float, generation_total: float) -> tuple[float, float]:
        now = time.monotonic()
        self._samples.append((now, prompt_total, generation_total))
        while len(self._samples) > 2 and now - self._samples[1][0] >= WINDOW_S:
            self._samples.popleft()
        t0, p0, g0 = self._samples[0]
        span = now - t0
        if span <= 0:
            return 0.0, 0.0
        return max(0.0, prompt_total - p0) / span, max(0.0, generation_total - g0) / span


def server_status(ctx: Any, meter: ThroughputMeter) -> dict[str, Any]:
    """`ctx` is the server's ServingContext."""
    stats = ctx.engine.last_stats or {}
    prompt_total = float(stats.get("num_prompt_tokens", 0) or 0)
    generation_total = float(stats.get("num_generation_tokens", 0) or 0)
    prompt_rate, generation_rate = meter.rates(prompt_total, generation_total)
    queries = float(stats.get("prefix_cache_queries", 0) or 0)
    hits = float(stats.get("prefix_cache_hits", 0) or 0)
    return {
        "model": ctx.model_name,
        "version": ferrox.__version__,
        "healthy": bool(ctx.engine.is_running),
        "uptime_s": round(time.monotonic() - meter.started, 1),
        "max_model_len": ctx.max_model_len,
        "requests_running": int(stats.get("num_running", 0) or 0),
        "requests_waiting": int(stats.get("num_waiting", 0) or 0),
        "kv_cache_usage": float(stats.get("kv_cache_usage", 0.0) or 0.0),
        "prompt_tokens_total": int(prompt_total),
        "generation_tokens_total": int(generation_total),
        "prompt_tokens_per_s": round(prompt_rate, 2),
        "generation_tokens_per_s": round(generation_rate, 2),
        "prefix_cache_hit_rate": hits / queries if queries else None,
    }
