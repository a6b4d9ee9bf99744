"""/metrics content, and a client that disconnects mid-stream freeing its request in the engine."""

from __future__ import annotations

import asyncio
import re
import time
import urllib.request

import aiohttp

MODEL = "smol"
METRIC_NAMES = (
    "ferrox:num_requests_running", "ferrox:num_requests_waiting", "ferrox:kv_cache_usage_perc",
    "ferrox:prefix_cache_queries_total", "ferrox:prefix_cache_hits_total", "ferrox:prompt_tokens_total",
    "ferrox:generation_tokens_total", "ferrox:request_success_total", "ferrox:num_preemptions_total",
    "ferrox:time_to_first_token_seconds_bucket", "ferrox:inter_token_latency_seconds_bucket",
    "ferrox:e2e_request_latency_seconds_bucket", "ferrox:request_queue_time_seconds_bucket",
)


def scrape(base_url: str) -> str:
    with urllib.request.urlopen(base_url + "/metrics", timeout=10) as resp:
        assert resp.headers["Content-Type"].startswith("text/plain")
        return resp.read().decode()


def value(text: str, name: str, **labels: str) -> float:
    total = 0.0
    found = False
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
            found = True
    assert found, f"{name}{labels} not in /metrics"
    return total


def test_metrics_names_and_labels(base_url):
    # Make sure at least one request finished so the histograms have samples.
    body = b'{"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}'
    req = urllib.request.Request(base_url + "/v1/chat/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    urllib.request.urlopen(req, timeout=60).read()
    text = scrape(base_url)
    for name in METRIC_NAMES:
        lines = [ln for ln in text.splitlines() if ln.startswith(name)]
        assert lines, f"{name} missing"
        assert all(f'model_name="{MODEL}"' in ln for ln in lines), lines[:2]
    assert value(text, "ferrox:generation_tokens_total") >= 3
    assert value(text, "ferrox:prompt_tokens_total") > 0
    assert value(text, "ferrox:time_to_first_token_seconds_count") >= 1
    assert value(text, "ferrox:e2e_request_latency_seconds_count") >= 1
    assert re.search(r'ferrox:request_success_total\{[^}]*finished_reason="(stop|length)"', text)


def test_disconnect_mid_stream_frees_the_request(base_url):
    idle_usage = value(scrape(base_url), "ferrox:kv_cache_usage_perc")
    aborted_before = _aborted(scrape(base_url))

    async def stream_then_disconnect() -> int:
        body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 900, "stream": True,
                "ignore_eos": True}
        chunks = 0
        async with aiohttp.ClientSession() as session:
            async with session.post(base_url + "/v1/completions", json=body) as resp:
                assert resp.status == 200
                async for line in resp.content:
                    if line.startswith(b"data: "):
                        chunks += 1
                    if chunks == 5:
                        break  # leaving the block closes the connection mid-stream
            return chunks

    assert asyncio.run(stream_then_disconnect()) == 5
    # Mid-stream the request held KV blocks; once the server notices the disconnect it aborts
    # the request, and the next core iteration frees them.
    deadline = time.monotonic() + 10
    while True:
        text = scrape(base_url)
        running = value(text, "ferrox:num_requests_running")
        usage = value(text, "ferrox:kv_cache_usage_perc")
        if running == 0 and usage == idle_usage and _aborted(text) > aborted_before:
            break
        assert time.monotonic() < deadline, f"running={running} usage={usage} (idle {idle_usage})"
        time.sleep(0.1)


def _aborted(text: str) -> float:
    try:
        return value(text, "ferrox:request_success_total", finished_reason="abort")
    except AssertionError:
        return 0.0
