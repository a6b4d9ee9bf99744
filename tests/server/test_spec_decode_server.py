"""`ferrox serve --speculative-config JSON` (n-gram) driven by the official `openai` client: greedy
answers equal the plain server's (the session `server` fixture), streamed and not; /metrics exports
vLLM's spec_decode counters; the periodic log line shows the mean acceptance length. The Prometheus
and log-line rendering from a core's stats snapshot is also checked directly (exact numbers)."""

from __future__ import annotations

import json
import re
import time
import urllib.request

import openai
import pytest
from ferrox.metrics.log_stats import LoggingStatLogger
from ferrox.metrics.prometheus import PrometheusStatLogger

from tests.server.server_proc import ServerProcess

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}
CODE = "def add(a, b):\n    return a + b\n\n\ndef mul(a, b):\n    return a * b\n"
MESSAGES = [{"role": "user", "content": "Repeat this text exactly:\n" + CODE}]


@pytest.fixture(scope="module")
def spec_server():
    srv = ServerProcess("--speculative-config", json.dumps(SPEC), "--served-model-name", "smol",
                        env={"FERROX_LOG_STATS_INTERVAL": "1"})
    yield srv
    assert srv.stop() == 0, "\n".join(srv.log[-30:])


def client_for(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)


def answer(client: openai.OpenAI, stream: bool = False) -> str:
    kw = dict(model="smol", messages=MESSAGES, temperature=0, max_tokens=48)
    if not stream:
        return client.chat.completions.create(**kw).choices[0].message.content or ""
    return "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(**kw, stream=True)
                   if c.choices)


def metric(text: str, name: str) -> float:
    match = re.search(rf"^{re.escape(name)}\{{[^}}]*\}} ([0-9.e+]+)$", text, re.M)
    assert match, f"{name} not in /metrics"
    return float(match.group(1))


def test_spec_server_matches_plain_server_and_exports_metrics(spec_server, base_url):
    with client_for(spec_server.base_url) as spec, client_for(base_url) as plain:
        expected = answer(plain)
        assert "return a * b" in expected
        assert answer(spec) == expected
        assert answer(spec, stream=True) == expected
    with urllib.request.urlopen(spec_server.base_url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    drafts = metric(text, "ferrox:spec_decode_num_drafts_total")
    draft_tokens = metric(text, "ferrox:spec_decode_num_draft_tokens_total")
    accepted = metric(text, "ferrox:spec_decode_num_accepted_tokens_total")
    assert 0 < accepted <= draft_tokens <= 4 * drafts
    per_pos = [float(v) for v in re.findall(
        r'^ferrox:spec_decode_num_accepted_tokens_per_pos_total\{[^}]*position="\d"[^}]*\} ([0-9.e+]+)$', text, re.M)]
    assert len(per_pos) == 4 and sum(per_pos) == accepted
    deadline = time.monotonic() + 10
    while not any("mean acceptance length" in line for line in spec_server.log) and time.monotonic() < deadline:
        time.sleep(0.2)
    # The stats line is periodic (FERROX_LOG_STATS_INTERVAL): on a slow box it may come a little later.
    deadline = time.monotonic() + 20
    while not any(re.search(r"spec decode mean acceptance length [1-5]\.\d\d", line) for line in spec_server.log):
        assert time.monotonic() < deadline, "no stats line with the mean acceptance length"
        time.sleep(0.2)


def test_spec_metrics_rendering_from_a_snapshot():
    stats = {"num_speculative_tokens": 3, "spec_num_drafts": 10, "spec_num_draft_tokens": 30,
             "spec_num_accepted_tokens": 18, "spec_num_accepted_tokens_per_pos": [9, 6, 3]}
    prom = PrometheusStatLogger("m")
    prom.on_scheduler_stats(stats)
    text = prom.render().decode()
    assert metric(text, "ferrox:spec_decode_num_drafts_total") == 10
    assert 'ferrox:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="2"} 3.0' in text
    # A core that does not speculate exports no spec series.
    prom.on_scheduler_stats({"num_running": 1})
    assert "spec_decode" not in prom.render().decode()
    line_logger = LoggingStatLogger(interval_s=3600)
    try:
        line_logger.on_scheduler_stats(stats)
        assert line_logger.log_interval()[0].endswith("spec decode mean acceptance length 2.80")
        line_logger.on_scheduler_stats({**stats, "spec_num_drafts": 20, "spec_num_accepted_tokens": 20})
        assert line_logger.log_interval()[0].endswith("mean acceptance length 1.20")  # the interval's: 1 + 2/10
    finally:
        line_logger.close()
