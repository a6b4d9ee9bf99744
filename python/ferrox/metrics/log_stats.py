"""The periodic engine log line, as vLLM prints it: what each engine core did in the last interval.

    engine 0: prompt throughput 812.4 tokens/s, generation throughput 95.1 tokens/s, running 4 reqs,
    waiting 0 reqs, KV cache usage 3.1%, prefix cache hit rate 41.7%

Every `FERROX_LOG_STATS_INTERVAL` seconds (default 10, vLLM's), while the engine is busy: an interval
in which nothing ran is logged once (so the last line shows the engine going idle) and then not
again until work comes. `disable_log_stats` (`--disable-log-stats`) leaves this logger out.

A timer thread, not the event loop, prints the line: the engine's owner may have no loop running
between requests, and the line must come on time while the loop is busy. The loop only adds to
running totals; the thread only reads them and keeps its own previous reading, so nothing is
written from both sides.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

from ferrox.metrics.prometheus import per_engine_stats
from ferrox.metrics.request_stats import IterationStats

INTERVAL_ENV = "FERROX_LOG_STATS_INTERVAL"
DEFAULT_INTERVAL_S = 10.0

logger = logging.getLogger("ferrox.metrics.log_stats")


class LoggingStatLogger:
    """Implements ferrox.metrics.request_stats.StatLogger; call close() to stop its thread."""

    def __init__(self, interval_s: float | None = None) -> None:
        self.interval_s = interval_s if interval_s is not None else float(
            os.environ.get(INTERVAL_ENV, DEFAULT_INTERVAL_S))
        # Running totals per engine core, written by the event loop only.
        self.prompt_tokens: list[int] = []
        self.generation_tokens: list[int] = []
        self.engines: list[dict[str, Any]] = []
        # The thread's previous reading.
        self._last_time = time.monotonic()
        self._last_prompt: list[int] = []
        self._last_generation: list[int] = []
        self._last_hits: list[float] = []
        self._last_queries: list[float] = []
        self._last_drafts: list[float] = []  # speculative decoding: drafts verified, tokens accepted
        self._last_accepted: list[float] = []
        self._was_busy = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ferrox-log-stats", daemon=True)
        self._thread.start()

    # ---- StatLogger (event loop) -------------------------------------------------------------------
    def on_scheduler_stats(self, stats: dict[str, Any]) -> None:
        self.engines = per_engine_stats(stats)
        self._grow(len(self.engines) - 1)

    def on_iteration(self, stats: IterationStats) -> None:
        self._grow(stats.engine)
        self.prompt_tokens[stats.engine] += stats.num_prompt_tokens
        self.generation_tokens[stats.engine] += stats.num_generation_tokens

    def _grow(self, engine: int) -> None:
        while len(self.prompt_tokens) <= engine:
            self.prompt_tokens.append(0)
            self.generation_tokens.append(0)

    # ---- the line (timer thread) -----------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.log_interval()
            except Exception:  # a logging bug must not kill the thread silently forever
                logger.exception("stats log line failed")

    def log_interval(self) -> list[str]:
        """Log one line per engine core for the time since the previous call; returns the lines."""
        now = time.monotonic()
        elapsed = max(now - self._last_time, 1e-9)
        self._last_time = now
        engines = list(self.engines)
        count = max(len(engines), len(self.prompt_tokens))
        for previous in (self._last_prompt, self._last_generation, self._last_hits, self._last_queries,
                         self._last_drafts, self._last_accepted):
            previous.extend([0] * (count - len(previous)))
        lines: list[str] = []
        busy = False
        for i in range(count):
            stats = engines[i] if i < len(engines) else {}
            prompt = self.prompt_tokens[i] if i < len(self.prompt_tokens) else 0
            generation = self.generation_tokens[i] if i < len(self.generation_tokens) else 0
            hits = float(stats.get("prefix_cache_hits", 0) or 0)
            queries = float(stats.get("prefix_cache_queries", 0) or 0)
            new_prompt, new_generation = prompt - self._last_prompt[i], generation - self._last_generation[i]
            new_hits, new_queries = hits - self._last_hits[i], queries - self._last_queries[i]
            self._last_prompt[i], self._last_generation[i] = prompt, generation
            self._last_hits[i], self._last_queries[i] = hits, queries
            running, waiting = int(stats.get("num_running", 0) or 0), int(stats.get("num_waiting", 0) or 0)
            busy = busy or bool(new_prompt or new_generation or running or waiting)
            # The interval's hit rate; with no lookups in it, the rate since start.
            rate = new_hits / new_queries if new_queries > 0 else (hits / queries if queries > 0 else 0.0)
            lines.append(
                f"engine {i}: prompt throughput {new_prompt / elapsed:.1f} tokens/s, "
                f"generation throughput {new_generation / elapsed:.1f} tokens/s, "
                f"running {running} reqs, waiting {waiting} reqs, "
                f"KV cache usage {100 * float(stats.get('kv_cache_usage', 0) or 0):.1f}%, "
                f"prefix cache hit rate {100 * rate:.1f}%" + self._spec_part(i, stats)
            )
        level = logging.INFO if busy or self._was_busy else logging.DEBUG
        self._was_busy = busy
        for line in lines:
            logger.log(level, "%s", line)
        return lines

    def _spec_part(self, i: int, stats: dict[str, Any]) -> str:
        """', spec decode mean acceptance length 2.84 (1 + accepted drafts per draft)' for a core that
        speculates: the interval's, or since start when it verified nothing in the interval."""
        if not stats.get("num_speculative_tokens"):
            return ""
        drafts = float(stats.get("spec_num_drafts", 0) or 0)
        accepted = float(stats.get("spec_num_accepted_tokens", 0) or 0)
        new_drafts, new_accepted = drafts - self._last_drafts[i], accepted - self._last_accepted[i]
        self._last_drafts[i], self._last_accepted[i] = drafts, accepted
        if new_drafts <= 0:
            new_drafts, new_accepted = drafts, accepted
        mean = 1 + new_accepted / new_drafts if new_drafts > 0 else 0.0
        return f", spec decode mean acceptance length {mean:.2f}"

    def close(self) -> None:
        self._stop.set()
