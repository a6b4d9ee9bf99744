"""`ferrox serve --data-parallel-size 2`: two engine-core processes behind one API server.

Both cores serve (seen in /metrics' per-engine series), greedy answers equal one core's, a shared
prompt prefix stays on one core, an abort reaches the core that owns the request, each core has
its periodic stats line, and killing one core fails every client and takes the server down.
The last test kills the module's server, so it runs last.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import time
import urllib.request

import aiohttp
import pytest

from tests.server.server_proc import ServerProcess, pid_alive
from tests.server.test_metrics_disconnect import scrape, value
from tests.server.test_sleep_server import call, check_abort_then_queue_until_wake

PROMPTS = ["The capital of France is", "1, 2, 3, 4,", "Once upon a time", "def fibonacci(n):"]
STREAM_BODY = {"prompt": "Once upon a time", "max_tokens": 1000, "ignore_eos": True, "stream": True}


@pytest.fixture(scope="module")
def dp_server():
    srv = ServerProcess("--data-parallel-size", "2", "--served-model-name", "smol", "--enable-sleep-mode",
                        env={"FERROX_LOG_STATS_INTERVAL": "1", "VLLM_SERVER_DEV_MODE": "1"})
    yield srv
    srv.stop()


def core_pids(srv: ServerProcess) -> dict[int, int]:
    pids: dict[int, int] = {}
    for line in srv.log:
        match = re.search(r"engine core (\d+) on .*: pid (\d+)", line)
        if match:
            pids[int(match.group(1))] = int(match.group(2))
    return pids


async def complete(session: aiohttp.ClientSession, base_url: str, prompt: str, max_tokens: int = 12) -> dict:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    async with session.post(base_url + "/v1/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        return await resp.json()


def complete_all(base_url: str, prompts: list[str]) -> list[str]:
    async def run() -> list[str]:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
            outs = await asyncio.gather(*(complete(session, base_url, p) for p in prompts))
        return [o["choices"][0]["text"] for o in outs]

    return asyncio.run(run())


def test_both_cores_serve_and_answers_equal_one_core(dp_server, server):
    pids = core_pids(dp_server)
    assert sorted(pids) == [0, 1] and pids[0] != pids[1] and all(pid_alive(p) for p in pids.values())
    before = scrape(dp_server.base_url)
    assert 'engine="0"' in before and 'engine="1"' in before  # both cores' series exist from the start
    dp_answers = complete_all(dp_server.base_url, PROMPTS)
    assert dp_answers == complete_all(server.base_url, PROMPTS)
    text = scrape(dp_server.base_url)
    for engine in ("0", "1"):
        assert value(text, "ferrox:request_success_total", engine=engine) >= 1, engine
        assert value(text, "ferrox:generation_tokens_total", engine=engine) > 0, engine
        assert value(text, "ferrox:e2e_request_latency_seconds_count", engine=engine) >= 1, engine
    assert value(text, "ferrox:request_success_total") == len(PROMPTS)


def test_shared_prefix_stays_on_one_core(dp_server):
    words = "quartz river maple copper falcon meadow silver harbor ember tundra violet walnut".split()
    prompt = " ".join(f"{words[i % len(words)]}{i}" for i in range(36))

    def per_engine(text: str, name: str) -> list[float]:
        return [value(text, name, engine=e) for e in ("0", "1")]

    before = scrape(dp_server.base_url)

    async def run() -> list[dict]:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
            return [await complete(session, dp_server.base_url, prompt, max_tokens=2) for _ in range(3)]

    outs = asyncio.run(run())
    after = scrape(dp_server.base_url)
    num_prompt = outs[0]["usage"]["prompt_tokens"]
    full_blocks = (num_prompt - 1) // 16 * 16  # the last prompt token is always computed
    assert full_blocks >= 64, num_prompt
    cached = [a - b for a, b in zip(per_engine(after, "ferrox:prompt_tokens_cached_total"),
                                    per_engine(before, "ferrox:prompt_tokens_cached_total"), strict=True)]
    # Requests one at a time tie on load; the prefix sends the 2nd and 3rd to the 1st's core,
    # where both find its blocks. (Rotation alone would have sent the 2nd to the other core.)
    assert sorted(cached) == [0, 2 * full_blocks], cached
    # Whole prompts are counted, cached part included.
    prompt_tokens = [a - b for a, b in zip(per_engine(after, "ferrox:prompt_tokens_total"),
                                           per_engine(before, "ferrox:prompt_tokens_total"), strict=True)]
    assert sorted(prompt_tokens) == [0, 3 * num_prompt], prompt_tokens


def test_prompt_cache_keys_pick_the_core(dp_server):
    """Chat requests one at a time, conversations A and B alternating: their prompts share the chat
    template's system prompt, whose cached blocks alone would send every request to one core; the
    prompt_cache_key sends each conversation to its own (a new key takes the next core in turn)."""
    def per_engine(text: str) -> list[float]:
        return [value(text, "ferrox:prompt_tokens_total", engine=e) for e in ("0", "1")]

    async def run() -> int:
        total = 0
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
            for i in range(4):
                body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
                        "prompt_cache_key": f"conversation-{'AB'[i % 2]}-{id(session)}"}
                async with session.post(dp_server.base_url + "/v1/chat/completions", json=body) as resp:
                    assert resp.status == 200, await resp.text()
                    total += (await resp.json())["usage"]["prompt_tokens"]
        return total

    before = per_engine(scrape(dp_server.base_url))
    total = asyncio.run(run())
    grew = [a - b for a, b in zip(per_engine(scrape(dp_server.base_url)), before, strict=True)]
    assert grew == [total / 2, total / 2], grew


def test_abort_reaches_the_owning_core(dp_server):
    async def run() -> list[float]:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
            responses = [await session.post(dp_server.base_url + "/v1/completions", json=STREAM_BODY)
                         for _ in range(2)]
            for resp in responses:
                assert resp.status == 200
                chunks = 0
                async for line in resp.content:
                    chunks += line.startswith(b"data: ")
                    if chunks == 3:
                        break
            # One long request on each core (least loaded first). A core's gauges come with its outputs
            # at most every 0.2 s, so a scrape right after the first chunks can be stale: poll.
            deadline = time.monotonic() + 10
            while True:
                running = [value(scrape(dp_server.base_url), "ferrox:num_requests_running", engine=e)
                           for e in "01"]
                if running == [1, 1] or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.1)
            for resp in responses:
                resp.close()  # the client goes away mid-stream: the server aborts its request
            return running

    assert asyncio.run(run()) == [1, 1]
    deadline = time.monotonic() + 5
    while True:
        text = scrape(dp_server.base_url)
        running = [value(text, "ferrox:num_requests_running", engine=e) for e in "01"]
        if running == [0, 0]:
            break
        # A misrouted abort leaves its request generating ~1000 tokens: far longer than this.
        assert time.monotonic() < deadline, f"requests still running after their clients left: {running}"
        time.sleep(0.1)
    assert value(text, "ferrox:kv_cache_usage_perc") == 0


def test_each_core_logs_its_stats_line(dp_server):
    deadline = time.monotonic() + 5
    while True:
        lines = [ln for ln in dp_server.log if "prompt throughput" in ln]
        if any("engine 0:" in ln for ln in lines) and any("engine 1:" in ln for ln in lines):
            break
        assert time.monotonic() < deadline, "\n".join(dp_server.log[-20:])
        time.sleep(0.2)
    busy = [ln for ln in lines if not re.search(r"generation throughput 0\.0 tokens/s", ln)]
    assert busy, lines
    assert all(re.search(r"running \d+ reqs, waiting \d+ reqs, KV cache usage [\d.]+%, prefix cache hit rate [\d.]+%",
                         ln) for ln in lines), lines[:2]


def test_sleep_reaches_every_core(dp_server):
    """Sleep mode's routes act on every core: both sleep (a request waits), both wake, answers unchanged."""
    before = complete_all(dp_server.base_url, PROMPTS)
    check_abort_then_queue_until_wake(dp_server.base_url, "smol")
    status, _ = call(dp_server.base_url, "POST", "/sleep?level=1")
    assert status == 200
    with urllib.request.urlopen(dp_server.base_url + "/metrics", timeout=30) as resp:
        awake = [ln for ln in resp.read().decode().splitlines() if ":engine_sleep_state{" in ln and '"awake"' in ln]
    assert len(awake) == 2 and all(ln.endswith(" 0.0") for ln in awake), awake
    assert call(dp_server.base_url, "POST", "/wake_up")[0] == 200
    assert complete_all(dp_server.base_url, PROMPTS) == before


def test_a_dead_core_fails_every_client_and_the_server_exits(dp_server):
    srv = dp_server
    pids = core_pids(srv)

    async def stream(session: aiohttp.ClientSession, started: asyncio.Event, events: list[str]) -> None:
        async with session.post(srv.base_url + "/v1/completions", json=STREAM_BODY) as resp:
            assert resp.status == 200
            async for raw in resp.content:
                line = raw.decode().strip()
                if line.startswith("data: "):
                    events.append(line[6:])
                    if len(events) == 3:
                        started.set()

    async def run() -> tuple[list[list[str]], float]:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
            events: list[list[str]] = [[], []]
            started = [asyncio.Event(), asyncio.Event()]
            tasks = [asyncio.create_task(stream(session, started[i], events[i])) for i in range(2)]
            await asyncio.wait_for(asyncio.gather(*(s.wait() for s in started)), 60)
            os.kill(pids[1], signal.SIGKILL)
            killed_at = time.monotonic()
            await asyncio.wait_for(asyncio.gather(*tasks), 30)
            return events, time.monotonic() - killed_at

    events, errored_after = asyncio.run(run())
    # Both streams (one on each core) are told at once, in-band, rather than hanging.
    for stream_events in events:
        assert stream_events[-1] == "[DONE]", stream_events[-3:]
        assert json.loads(stream_events[-2])["error"]["type"] == "service_unavailable", stream_events[-2]
    assert errored_after < 5.0
    try:
        code = srv.proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        pytest.fail("server kept running after one of its engine cores died")
    assert code != 0
    deadline = time.monotonic() + 5
    while pid_alive(pids[0]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not pid_alive(pids[0]), "the surviving engine core outlived the server"
