"""The periodic engine stats line (LoggingStatLogger): its numbers, its idle rule, its timer, and
`disable_log_stats` as a flag. The line from a live server is checked in test_data_parallel.py."""

from __future__ import annotations

import logging
import re
import time

from ferrox.config import EngineConfig
from ferrox.entrypoints.cli import build_parser, engine_config_from_args
from ferrox.metrics.log_stats import LoggingStatLogger
from ferrox.metrics.request_stats import IterationStats

LOGGER = "ferrox.metrics.log_stats"


def engine_stats(running: int, waiting: int, hits: int, queries: int, usage: float) -> dict:
    return {"num_running": running, "num_waiting": waiting, "prefix_cache_hits": hits,
            "prefix_cache_queries": queries, "kv_cache_usage": usage}


def test_line_per_core_with_interval_rates(caplog):
    stat_logger = LoggingStatLogger(interval_s=3600)  # the timer stays out of the way: lines on demand
    try:
        caplog.set_level(logging.DEBUG, logger=LOGGER)
        stat_logger.on_scheduler_stats({"engines": [engine_stats(0, 0, 0, 0, 0.0), engine_stats(0, 0, 0, 0, 0.0)]})
        stat_logger.log_interval()
        caplog.clear()
        stat_logger.on_iteration(IterationStats(0, num_prompt_tokens=300, num_generation_tokens=40))
        stat_logger.on_iteration(IterationStats(1, num_generation_tokens=10))
        stat_logger.on_scheduler_stats({"engines": [engine_stats(3, 1, 30, 40, 0.25), engine_stats(1, 0, 0, 0, 0.5)]})
        stat_logger._last_time -= 2.0  # as if the interval had lasted two seconds
        lines = stat_logger.log_interval()
        assert len(lines) == 2
        rates = [float(x) for x in re.findall(r"([\d.]+) tokens/s", lines[0])]
        assert 149 <= rates[0] <= 150.5 and 19.9 <= rates[1] <= 20.1, lines[0]
        assert "running 3 reqs, waiting 1 reqs, KV cache usage 25.0%, prefix cache hit rate 75.0%" in lines[0]
        assert lines[1].startswith("engine 1: prompt throughput 0.0 tokens/s") and "KV cache usage 50.0%" in lines[1]
        assert [r.levelno for r in caplog.records] == [logging.INFO, logging.INFO]

        # Idle: one more line at info (the engine went idle), then only debug until work comes.
        stat_logger.on_scheduler_stats({"engines": [engine_stats(0, 0, 30, 40, 0.0), engine_stats(0, 0, 0, 0, 0.0)]})
        caplog.clear()
        stat_logger.log_interval()
        stat_logger.log_interval()
        assert [r.levelno for r in caplog.records] == [logging.INFO] * 2 + [logging.DEBUG] * 2
        # No lookups in the interval: the hit rate shown is the one since start.
        assert "prefix cache hit rate 75.0%" in caplog.records[0].getMessage()
    finally:
        stat_logger.close()


def test_timer_logs_while_busy_and_stops_on_close(caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    stat_logger = LoggingStatLogger(interval_s=0.1)
    stat_logger.on_iteration(IterationStats(0, num_generation_tokens=5))
    deadline = time.monotonic() + 5
    while not any("generation throughput" in r.getMessage() for r in caplog.records):
        assert time.monotonic() < deadline, "no stats line from the timer"
        time.sleep(0.02)
    stat_logger.close()
    stat_logger._thread.join(2)
    assert not stat_logger._thread.is_alive()


def test_disable_log_stats_flag():
    assert EngineConfig().disable_log_stats is False
    args = build_parser().parse_args(["serve", "--disable-log-stats"])
    assert engine_config_from_args(args).disable_log_stats is True
    assert engine_config_from_args(build_parser().parse_args(["serve"])).disable_log_stats is False
