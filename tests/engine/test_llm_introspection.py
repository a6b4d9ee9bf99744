"""`LLM.get_metrics()` and `LLM.apply_model()` (vLLM's). get_metrics: with disable_log_stats=False the
offline engine keeps vLLM's Prometheus metrics (ferrox/engine/offline_stats.py) and returns them as vLLM's
reader objects (ferrox/metrics/reader.py); with the LLM default (True, as vLLM's) it refuses by name.
apply_model: func(model) on the engine's model. A real tiny model and the real core."""

from __future__ import annotations

import pytest
from ferrox import LLM, SamplingParams
from ferrox.metrics.reader import Counter, Gauge, Histogram, Vector, snapshot
from prometheus_client import CollectorRegistry
from prometheus_client import Counter as PromCounter
from prometheus_client import Gauge as PromGauge
from prometheus_client import Histogram as PromHistogram


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    from tests.helpers.tiny_models import make_tiny_llama

    return make_tiny_llama(str(tmp_path_factory.mktemp("llama")))


def _by_name(metrics, name, **labels):
    return [m for m in metrics if m.name == name and all(m.labels.get(k) == v for k, v in labels.items())]


def test_reader_turns_families_into_vllm_objects():
    reg = CollectorRegistry()
    PromCounter("vllm:things", "doc", ["engine"], registry=reg).labels("0").inc(3)
    PromGauge("vllm:level", "doc", registry=reg).set(0.5)
    PromGauge("other:level", "doc", registry=reg).set(9)  # another prefix: not read
    hist = PromHistogram("vllm:latency_seconds", "doc", ["engine"], buckets=(0.1, 1.0), registry=reg)
    for value in (0.05, 0.5, 5.0):
        hist.labels("0").observe(value)
    per_pos = PromCounter("vllm:spec_decode_num_accepted_tokens_per_pos", "doc", ["engine", "position"],
                          registry=reg)
    per_pos.labels("0", "1").inc(2)
    per_pos.labels("0", "0").inc(5)
    got = snapshot(reg)
    assert Counter("vllm:things", {"engine": "0"}, 3) in got
    assert Gauge("vllm:level", {}, 0.5) in got and not _by_name(got, "other:level")
    assert Histogram("vllm:latency_seconds", {"engine": "0"}, 3, 5.55,
                     {"0.1": 1, "1.0": 2, "+Inf": 3}) in got
    assert Vector("vllm:spec_decode_num_accepted_tokens_per_pos", {"engine": "0"}, [5, 2]) in got


def test_get_metrics_after_generate(tiny_llama):
    llm = LLM(tiny_llama, device="cpu", kv_cache_memory=16 << 20, disable_log_stats=False,
              speculative_config={"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1,
                                  "prompt_lookup_max": 2})
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6], [9, 10, 11], [12, 13, 14, 15, 16]]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    metrics = llm.get_metrics()
    labels = {"model_name": llm.engine.model_name, "engine": "0"}
    assert _by_name(metrics, "vllm:request_success", finished_reason="length", **labels)[0].value == 3
    assert _by_name(metrics, "vllm:prompt_tokens", **labels)[0].value == sum(map(len, prompts))
    assert _by_name(metrics, "vllm:generation_tokens", **labels)[0].value == generated == 18
    ttft = _by_name(metrics, "vllm:time_to_first_token_seconds", **labels)[0]
    assert isinstance(ttft, Histogram) and ttft.count == 3 and ttft.buckets["+Inf"] == 3 and ttft.sum > 0
    e2e = _by_name(metrics, "vllm:e2e_request_latency_seconds", **labels)[0]
    assert e2e.count == 3
    running = _by_name(metrics, "vllm:num_requests_running", **labels)[0]
    assert isinstance(running, Gauge) and running.value == 0
    per_pos = _by_name(metrics, "vllm:spec_decode_num_accepted_tokens_per_pos", **labels)
    assert len(per_pos) == 1 and isinstance(per_pos[0], Vector) and len(per_pos[0].values) == 2
    assert _by_name(metrics, "vllm:request_params_n", **labels)[0].buckets["1.0"] == 3
    max_tokens = _by_name(metrics, "vllm:request_params_max_tokens", **labels)[0]
    assert max_tokens.count == 3 and max_tokens.sum == 18
    steps = _by_name(metrics, "vllm:iteration_tokens_total", **labels)[0]  # tokens computed per engine step
    assert isinstance(steps, Histogram) and steps.count >= 6 and steps.sum == sum(map(len, prompts)) + generated
    (cache,) = _by_name(metrics, "vllm:cache_config_info")
    assert cache.value == 1 and cache.labels["engine"] == "0" and cache.labels["block_size"] == "16"
    assert cache.labels["num_gpu_blocks"] == str(llm.engine.num_kv_blocks)
    assert cache.labels["enable_prefix_caching"] == "True" and cache.labels["cache_dtype"] == "auto"
    assert cache.labels["swap_space"] == "4.0" and cache.labels["swap_space_bytes"] == "4294967296.0"  # vLLM's V1 rendering
    assert all(m.name.startswith("vllm:") for m in metrics)


def test_get_metrics_refused_by_default(tiny_llama):
    llm = LLM(tiny_llama, device="cpu", kv_cache_memory=16 << 20)
    assert llm.config.disable_log_stats is True  # vLLM's LLM default
    with pytest.raises(RuntimeError, match="disable_log_stats=False"):
        llm.get_metrics()


def test_apply_model_runs_on_the_model_and_can_change_weights(tiny_llama):
    """vLLM's LLM.apply_model: func(model) on the one worker's model; an in-place weight change shows in the
    next generate (after reset_prefix_cache), and restoring it brings the old tokens back."""
    import torch

    llm = LLM(tiny_llama, device="cpu", kv_cache_memory=16 << 20)
    assert llm.apply_model(lambda m: isinstance(m, torch.nn.Module)) == [True]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompt = [{"prompt_token_ids": [5, 6, 7]}]
    before = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    (saved,) = llm.apply_model(lambda m: {n: p.detach().clone() for n, p in m.named_parameters()})

    def scramble(model):
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(-1.5)

    llm.apply_model(scramble)
    assert llm.reset_prefix_cache()
    changed = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    assert changed != before

    def restore(model):
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(saved[n])

    llm.apply_model(restore)
    llm.reset_prefix_cache()
    assert llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids == before


def test_get_metrics_counts_a_request_of_n_samples_with_its_n(tiny_llama):
    """A request of n = 2 becomes two engine requests; each finishes with the user request's n (2), as the
    server's metrics count it."""
    llm = LLM(tiny_llama, device="cpu", kv_cache_memory=16 << 20, disable_log_stats=False)
    llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(n=2, temperature=1.0, max_tokens=3, ignore_eos=True),
                 use_tqdm=False)
    (n_hist,) = _by_name(llm.get_metrics(), "vllm:request_params_n")
    assert n_hist.count == 2 and n_hist.sum == 4
