"""/metrics per request, on the shared one-core server: whole prompts counted (vLLM's meaning of
ferrox:prompt_tokens), their cached part apart, and vLLM's request histograms."""

from __future__ import annotations

import json
import urllib.request

from tests.server.test_metrics_disconnect import scrape, value

HISTOGRAMS = (
    "ferrox:time_to_first_token_seconds", "ferrox:e2e_request_latency_seconds", "ferrox:request_queue_time_seconds",
    "ferrox:request_prefill_time_seconds", "ferrox:request_decode_time_seconds",
    "ferrox:request_inference_time_seconds", "ferrox:request_time_per_output_token_seconds",
    "ferrox:request_prompt_tokens", "ferrox:request_generation_tokens",
)


def complete(base_url: str, prompt: str, max_tokens: int) -> dict:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    req = urllib.request.Request(base_url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        return json.loads(resp.read())


def delta(after: str, before: str, name: str) -> float:
    return value(after, name) - value(before, name)


def test_whole_prompts_and_their_cached_part_are_counted(base_url):
    words = "lantern pebble saffron glacier orchid thistle canyon mosaic nimbus quiver".split()
    prompt = " ".join(f"{words[i % len(words)]}-{i}" for i in range(30))
    before = scrape(base_url)
    first = complete(base_url, prompt, 4)
    middle = scrape(base_url)
    second = complete(base_url, prompt, 4)
    after = scrape(base_url)

    num_prompt = first["usage"]["prompt_tokens"]
    assert num_prompt > 40, num_prompt
    # A prompt no other test sends: nothing cached the first time, every full block the second
    # (the last prompt token is always computed, so a prompt of whole blocks keeps one back).
    assert delta(middle, before, "ferrox:prompt_tokens_total") == num_prompt
    assert delta(middle, before, "ferrox:prompt_tokens_cached_total") == 0
    assert delta(after, middle, "ferrox:prompt_tokens_total") == num_prompt
    cached = (num_prompt - 1) // 16 * 16
    assert delta(after, middle, "ferrox:prompt_tokens_cached_total") == cached
    # vLLM's prompt_tokens_by_source: computed, or from the device's prefix cache (no host tier here).
    by_source = "ferrox:prompt_tokens_by_source_total"
    assert value(middle, by_source, source="local_compute") - value(before, by_source, source="local_compute") \
        == num_prompt
    assert value(after, by_source, source="local_compute") - value(middle, by_source, source="local_compute") \
        == num_prompt - cached
    assert value(after, by_source, source="local_cache_hit") - value(middle, by_source, source="local_cache_hit") \
        == cached
    assert value(after, by_source, source="external_kv_transfer") == 0
    assert "ferrox:external_prefix_cache_hits" not in after  # (registered with a host tier only, as vLLM's)
    details = second["usage"].get("prompt_tokens_details")
    if details is not None:
        assert details["cached_tokens"] == cached

    for name in HISTOGRAMS:
        assert delta(after, before, name + "_count") == 2, name
    assert delta(after, before, "ferrox:request_prompt_tokens_sum") == 2 * num_prompt
    generated = first["usage"]["completion_tokens"] + second["usage"]["completion_tokens"]
    assert generated == 8
    assert delta(after, before, "ferrox:request_generation_tokens_sum") == generated
    # The phases nest: queue + inference <= e2e, prefill + decode == inference.
    sums = {name: delta(after, before, name + "_sum") for name in HISTOGRAMS}
    assert sums["ferrox:request_queue_time_seconds"] + sums["ferrox:request_inference_time_seconds"] <= (
        sums["ferrox:e2e_request_latency_seconds"] + 1e-6)
    assert abs(sums["ferrox:request_prefill_time_seconds"] + sums["ferrox:request_decode_time_seconds"]
               - sums["ferrox:request_inference_time_seconds"]) < 1e-6
    assert sums["ferrox:request_decode_time_seconds"] > 0
    # Token-count buckets run 1, 2, 5, 10, ... up to the context length (1024 here).
    buckets = [ln for ln in after.splitlines() if ln.startswith("ferrox:request_prompt_tokens_bucket")]
    assert any('le="1000.0"' in ln for ln in buckets) and not any('le="2000.0"' in ln for ln in buckets)
