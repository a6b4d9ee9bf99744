"""A second server with an API key (from $FERROX_API_KEY): 401s, open probe routes; then its
engine-core process is killed: in-flight requests error, /health turns 503, the server exits
non-zero."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import time
from typing import Any

import aiohttp
import anthropic
import openai
import pytest

from tests.server.server_proc import ServerProcess, pid_alive

KEY = "sk-test-123"


@pytest.fixture(scope="module")
def keyed_server():
    srv = ServerProcess(env={"FERROX_API_KEY": KEY})
    yield srv
    srv.stop(signal.SIGKILL)


def request(url: str, method: str = "GET", headers: dict[str, str] | None = None,
            body: Any = None) -> tuple[int, Any]:
    async def run() -> tuple[int, Any]:
        async with aiohttp.ClientSession() as session:
            async with session.request(method, url, headers=headers or {}, json=body) as resp:
                text = await resp.text()
                is_json = resp.content_type == "application/json"
                return resp.status, (json.loads(text) if is_json else text)

    return asyncio.run(run())


def test_probe_routes_need_no_key(keyed_server):
    for path in ("/health", "/metrics", "/version"):
        status, _ = request(keyed_server.base_url + path)
        assert status == 200, path


def test_missing_or_wrong_key_is_401(keyed_server):
    url = keyed_server.base_url + "/v1/models"
    for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": KEY}):
        status, body = request(url, headers=headers)
        assert status == 401
        assert body["error"]["type"] == "authentication_error" and body["error"]["code"] == "invalid_api_key"
    status, body = request(keyed_server.base_url + "/v1/messages", "POST", {"x-api-key": "bad"},
                           {"max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
    assert status == 401 and body["type"] == "error" and body["error"]["type"] == "authentication_error"


def test_clients_with_the_key_work(keyed_server):
    with openai.OpenAI(base_url=keyed_server.base_url + "/v1", api_key=KEY, max_retries=0) as client:
        resp = client.chat.completions.create(model=client.models.list().data[0].id, max_tokens=3,
                                              messages=[{"role": "user", "content": "Hi"}])
        assert resp.usage.completion_tokens > 0
    with openai.OpenAI(base_url=keyed_server.base_url + "/v1", api_key="wrong", max_retries=0) as client:
        with pytest.raises(openai.AuthenticationError):
            client.models.list()
    with anthropic.Anthropic(base_url=keyed_server.base_url, api_key=KEY, max_retries=0) as client:
        msg = client.messages.create(model="SmolLM2-135M-Instruct", max_tokens=3,
                                     messages=[{"role": "user", "content": "Hi"}])
        assert msg.usage.output_tokens > 0


def test_engine_core_death(keyed_server):
    srv = keyed_server
    assert srv.core_pid is not None and pid_alive(srv.core_pid)
    headers = {"Authorization": f"Bearer {KEY}"}

    async def run() -> tuple[list[str], float, int]:
        body = {"prompt": "Once upon a time", "max_tokens": 900, "ignore_eos": True, "stream": True}
        events: list[str] = []
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
            async with session.post(srv.base_url + "/v1/completions", json=body, headers=headers) as resp:
                assert resp.status == 200
                async for raw in resp.content:
                    line = raw.decode().strip()
                    if not line.startswith("data: "):
                        continue
                    events.append(line[6:])
                    if len(events) == 3:
                        os.kill(srv.core_pid, signal.SIGKILL)
                        killed_at = time.monotonic()
            errored_after = time.monotonic() - killed_at
            try:
                async with session.get(srv.base_url + "/health") as health:
                    health_status = health.status
            except aiohttp.ClientConnectionError:
                # Only acceptable if the server already exited (its grace period is short).
                health_status = 503 if srv.proc.poll() not in (None, 0) else -1
        return events, errored_after, health_status

    events, errored_after, health_status = asyncio.run(run())
    # The in-flight stream is told at once (in-band error, then [DONE]) rather than hanging.
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])
    assert error["error"]["type"] == "service_unavailable", error
    assert errored_after < 5.0
    assert health_status == 503
    # ... and the server exits non-zero on its own.
    try:
        code = srv.proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        pytest.fail("server kept running after its engine core died")
    assert code != 0
