"""Stat logging for the offline `LLM` (vLLM's, with disable_log_stats=False; LLM's default is True, as
vLLM's): the periodic log line (metrics/log_stats.py) and the Prometheus metrics under vLLM's `vllm:`
names (metrics/prometheus.py), fed from the offline loop as AsyncLLM feeds them from its output
reader, and read back by `LLM.get_metrics()` (metrics/reader.py).

The offline loop runs the core in the caller's thread: each step's results are observed with the
step's start and end times, and the core's scheduler stats (running / waiting, KV usage, prefix-cache
and speculative counters) are taken after every step.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from ferrox.metrics.log_stats import LoggingStatLogger
from ferrox.metrics.prometheus import PrometheusStatLogger
from ferrox.metrics.reader import Metric, snapshot
from ferrox.metrics.request_stats import (
    IterationStats,
    RequestTiming,
    finished_stats,
    observe,
    request_timing,
)
from ferrox.step_types import StepResult

if TYPE_CHECKING:
    from ferrox.engine.protocol import EngineCoreRequest

PREFIX = "vllm"  # LLM.get_metrics() reads vLLM's names, whatever a server's --metrics-prefix


class OfflineStats:
    def __init__(self, model_name: str, max_model_len: int, mm_cache: Any = None) -> None:
        """mm_cache: the multimodal processor cache the LLM prepares its prompts' images through, or None."""
        self.prometheus = PrometheusStatLogger(model_name, max_model_len=max_model_len, prefix=PREFIX,
                                               mm_cache=mm_cache)
        self.logger = LoggingStatLogger()
        self._loggers = (self.prometheus, self.logger)
        self._timing: dict[str, RequestTiming] = {}

    def add(self, request: EngineCoreRequest, engine_request_ids: list[str], max_model_len: int) -> None:
        """The user request and the engine requests it became (its n samples)."""
        queued = time.time()
        for rid in engine_request_ids:
            self._timing[rid] = request_timing(request, max_model_len, queued)

    def step(self, result: StepResult, step_start: float, core_stats: dict[str, Any]) -> None:
        now = time.time()
        iteration = IterationStats(0)
        observe(self._timing, 0, result, step_start, now, iteration)
        for stat_logger in self._loggers:
            stat_logger.on_scheduler_stats(core_stats)
            stat_logger.on_iteration(iteration)

    def aborted(self, engine_request_ids: list[str]) -> None:
        now = time.time()
        iteration = IterationStats(0)
        for rid in engine_request_ids:
            timing = self._timing.pop(rid, None)
            if timing is not None:
                iteration.finished.append(finished_stats(timing, 0, "abort", now))
        if iteration.finished:
            for stat_logger in self._loggers:
                stat_logger.on_iteration(iteration)

    def metrics(self) -> list[Metric]:
        return snapshot(self.prometheus.registry, PREFIX)

    def close(self) -> None:
        self.logger.close()
