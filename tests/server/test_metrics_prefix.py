"""`ferrox serve --metrics-prefix vllm`: every /metrics name in vLLM's namespace, the same names as ferrox's
own otherwise, so a Prometheus dashboard written for vLLM reads the server unchanged."""

from __future__ import annotations

import re

import pytest
from ferrox.entrypoints.cli import build_parser
from ferrox.metrics.prometheus import PrometheusStatLogger
from ferrox.metrics.request_stats import FinishedRequestStats, IterationStats

SNAPSHOT = {"num_running": 2, "num_waiting": 1, "kv_cache_usage": 0.25, "prefix_cache_queries": 64,
            "prefix_cache_hits": 32, "num_generation_tokens": 7, "num_preemptions": 1, "num_speculative_tokens": 2,
            "spec_num_drafts": 3, "spec_num_draft_tokens": 6, "spec_num_accepted_tokens": 4,
            "spec_num_accepted_tokens_per_pos": [3, 1],
            "cache_config": {"block_size": 16, "num_gpu_blocks": 1000, "cache_dtype": "auto"}}


def _names(prefix: str) -> set[str]:
    prom = PrometheusStatLogger("m", max_model_len=256, prefix=prefix)
    prom.on_scheduler_stats(SNAPSHOT)
    done = FinishedRequestStats(engine=0, finish_reason="stop", num_prompt_tokens=5, num_generation_tokens=3,
                                e2e_latency=0.5, queue_time=0.01, prefill_time=0.1, decode_time=0.3,
                                inference_time=0.4, time_per_output_token=0.1, n=2, max_tokens=16)
    prom.on_iteration(IterationStats(engine=0, num_prompt_tokens=5, num_cached_tokens=2, num_generation_tokens=3,
                                     time_to_first_tokens=[0.1], inter_token_latencies=[(0.05, 2)], finished=[done]))
    text = prom.render().decode()
    return {m.group(1) for m in re.finditer(r"^([a-z_]+:[a-z0-9_]+)", text, re.MULTILINE)}


def test_vllm_prefix_names_every_series_as_vllm_does():
    ours, vllm = _names("ferrox"), _names("vllm")
    assert all(n.startswith("ferrox:") for n in ours) and all(n.startswith("vllm:") for n in vllm)
    assert {n.removeprefix("ferrox:") for n in ours} == {n.removeprefix("vllm:") for n in vllm}
    # the series vLLM's own Grafana dashboard queries
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:request_success_total",
                 "vllm:time_to_first_token_seconds_bucket", "vllm:inter_token_latency_seconds_bucket",
                 "vllm:e2e_request_latency_seconds_bucket", "vllm:request_prompt_tokens_bucket",
                 "vllm:request_generation_tokens_bucket", "vllm:prefix_cache_hits_total",
                 "vllm:spec_decode_num_accepted_tokens_total", "vllm:iteration_tokens_total_bucket",
                 "vllm:request_params_n_bucket", "vllm:request_params_max_tokens_bucket", "vllm:cache_config_info"):
        assert name in vllm, name


def test_the_flag_reaches_the_server_options_and_refuses_other_prefixes():
    parser = build_parser()
    assert parser.parse_args(["serve", "m", "--metrics-prefix", "vllm"]).metrics_prefix == "vllm"
    assert parser.parse_args(["serve", "m"]).metrics_prefix == "ferrox"
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "m", "--metrics-prefix", "sglang"])
    with pytest.raises(ValueError, match="metrics_prefix: 'sglang'"):
        PrometheusStatLogger("m", prefix="sglang")
