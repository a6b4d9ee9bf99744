"""vLLM's small frontend flags in a server: --sse-keep-alive-interval (SSE comments on idle chat and completions
streams, also while a request waits for its first output), --disable-access-log-for-endpoints,
--max-num-queued-tokens (503 while the prompts without a first output hold that many tokens) and
--enable-log-deltas. The stream mechanics run in-process on a stand-in route (fast, exact timing); one real
`ferrox serve` shows them together. Parse-level checks: tests/test_cli_switches.py."""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import threading
import time
import types
import urllib.error
import urllib.request
from collections.abc import AsyncGenerator

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from ferrox.entrypoints.openai.server import OPTIONS, access_log_middleware, error_middleware
from ferrox.entrypoints.openai.serving import (
    CTX,
    SSE_DONE,
    ServerOptions,
    end_sse,
    first_output,
    send_sse,
    start_sse,
)
from ferrox.errors import InvalidArgumentError

from tests.server.server_proc import ServerProcess

KEEP_ALIVE = ": keep-alive"


def _app(options: ServerOptions, outputs: AsyncGenerator[str, None], closed: list[str]) -> web.Application:
    """A stand-in for the chat / completions stream routes: the same helpers, outputs from `outputs`."""

    async def route(request: web.Request) -> web.StreamResponse:
        headers = {"X-Request-Id": "r1"}
        first = await first_output(outputs, "prompt", request=request, headers=headers)
        resp = await start_sse(request, headers, keep_alive=True)
        async with contextlib.aclosing(outputs):
            out = first
            while out is not None:
                await send_sse(resp, {"text": out})
                out = await anext(outputs, None)
        await end_sse(resp, [SSE_DONE])
        return resp

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application(middlewares=[access_log_middleware, error_middleware])
    app[OPTIONS] = options
    app[CTX] = types.SimpleNamespace(options=options)  # (what the helpers read of the serving context)
    app.router.add_post("/v1/completions", route)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", health)
    return app


async def _gen(steps: list[tuple[float, str | Exception]], closed: list[str]) -> AsyncGenerator[str, None]:
    try:
        for delay, item in steps:
            await asyncio.sleep(delay)
            if isinstance(item, Exception):
                raise item
            yield item
    finally:
        closed.append("closed")  # (AsyncLLM aborts the request here)


def _stream(steps: list[tuple[float, str | Exception]], interval: float) -> tuple[int, list[tuple[float, str]]]:
    """(status, [(seconds since the request, line)]) of one streamed request to the stand-in route."""

    async def run() -> tuple[int, list[tuple[float, str]]]:
        closed: list[str] = []
        app = _app(ServerOptions(sse_keep_alive_interval=interval), _gen(steps, closed), closed)
        async with TestClient(TestServer(app)) as client:
            start = time.monotonic()
            resp = await client.post("/v1/completions", json={})
            lines = []
            async for raw in resp.content:
                if raw.strip():
                    lines.append((time.monotonic() - start, raw.decode().strip()))
            return resp.status, lines

    return asyncio.run(run())


def test_keep_alive_comments_on_an_idle_stream():
    """A fast first output sends nothing early; an idle gap between outputs gets a comment every interval."""
    status, lines = _stream([(0.0, "a"), (0.7, "b")], interval=0.2)
    texts = [line for _, line in lines]
    assert status == 200 and texts[0] == 'data: {"text":"a"}' and texts[-1] == "data: [DONE]", texts
    gap = texts[1:texts.index('data: {"text":"b"}')]
    assert 2 <= len(gap) <= 4 and set(gap) == {KEEP_ALIVE}, texts
    status, lines = _stream([(0.0, "a"), (0.7, "b")], interval=0)  # 0: never (vLLM's default)
    assert [line for _, line in lines] == ['data: {"text":"a"}', 'data: {"text":"b"}', "data: [DONE]"]


def test_a_slow_first_output_starts_the_stream_with_keep_alives():
    """Waiting for the first output (queued, prefill) the client gets the headers and comments, as vLLM's."""
    status, lines = _stream([(0.7, "a")], interval=0.2)
    texts = [line for _, line in lines]
    assert status == 200 and texts[0] == KEEP_ALIVE and 0.15 < lines[0][0] < 0.5, lines
    assert texts[-2:] == ['data: {"text":"a"}', "data: [DONE]"] and set(texts[:-2]) == {KEEP_ALIVE}, texts


def test_an_error_after_the_stream_started_goes_in_band():
    """Headers are gone once the keep-alives began: the rejection comes as the stream's last event."""
    status, lines = _stream([(0.5, InvalidArgumentError("too long", param="prompt"))], interval=0.2)
    texts = [line for _, line in lines]
    assert status == 200 and texts[0] == KEEP_ALIVE and texts[-1] == "data: [DONE]", texts
    error = json.loads(texts[-2].removeprefix("data: "))["error"]
    assert error["message"] == "too long" and error["param"] == "prompt" and error["type"] == "invalid_request_error"
    # ... and before any keep-alive, it is a plain 400 as always
    assert _stream([(0.0, InvalidArgumentError("too long", param="prompt"))], interval=0.2)[0] == 400


def test_a_client_leaving_while_it_waits_ends_the_request():
    async def run() -> list[str]:
        closed: list[str] = []
        app = _app(ServerOptions(sse_keep_alive_interval=0.1), _gen([(30.0, "late")], closed), closed)
        async with TestClient(TestServer(app)) as client:
            resp = await client.post("/v1/completions", json={})
            assert (await resp.content.readline()).decode().strip() == KEEP_ALIVE
            resp.close()  # the client goes away
            for _ in range(50):
                if closed:
                    break
                await asyncio.sleep(0.05)
        return closed

    assert asyncio.run(run()) == ["closed"]


def test_access_log_leaves_out_the_paths_named(caplog):
    async def run() -> None:
        options = ServerOptions(access_log_excluded_paths=frozenset({"/health"}))
        async with TestClient(TestServer(_app(options, _gen([], []), []))) as client:
            for path in ("/health", "/health?probe=1", "/metrics"):
                assert (await client.get(path)).status == 200

    with caplog.at_level("INFO", logger="ferrox.access"):
        asyncio.run(run())
    lines = [r.getMessage() for r in caplog.records if r.name == "ferrox.access"]
    assert len(lines) == 1 and '"GET /metrics"' in lines[0], lines


# ---- one real server --------------------------------------------------------------------------------
def _read_stream(port: int, path: str, body: dict, into: list[tuple[float, str]], done: threading.Event) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    start = time.monotonic()
    conn.request("POST", path, json.dumps({**body, "stream": True}), {"Content-Type": "application/json"})
    resp = conn.getresponse()  # (with a keep-alive, the headers come with the first comment)
    try:
        for raw in resp:
            if raw.strip():
                into.append((time.monotonic() - start, raw.decode().strip()))
            if done.is_set():
                break
    finally:
        conn.close()


def test_server_keep_alives_queued_token_limit_access_log_and_deltas():
    """One request runs (--max-num-seqs 1), a chat stream waits behind it: it gets its headers and keep-alive
    comments while queued; its prompt is the prefill backlog, so with --max-num-queued-tokens 1 a third
    request gets 503 at once. /health and /metrics leave no access-log line; streamed deltas are logged."""
    srv = ServerProcess("--max-num-seqs", "1", "--sse-keep-alive-interval", "1", "--max-num-queued-tokens", "1",
                        "--disable-access-log-for-endpoints", "/health,/metrics", "--enable-log-requests",
                        "--enable-log-outputs")
    try:
        urllib.request.urlopen(srv.base_url + "/metrics", timeout=30).read()
        running: list[tuple[float, str]] = []
        queued: list[tuple[float, str]] = []
        stop_running = threading.Event()
        first = threading.Thread(target=_read_stream, args=(srv.port, "/v1/completions", {
            "prompt": "Once upon a time", "max_tokens": 900, "ignore_eos": True}, running, stop_running))
        first.start()
        deadline = time.monotonic() + 60
        while not running and time.monotonic() < deadline:
            time.sleep(0.05)
        second = threading.Thread(target=_read_stream, args=(srv.port, "/v1/chat/completions", {
            "messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 4}, queued, threading.Event()))
        second.start()
        while not queued and time.monotonic() < deadline:
            time.sleep(0.05)
        assert queued and queued[0][1] == KEEP_ALIVE and 0.5 < queued[0][0] < 3, queued
        req = urllib.request.Request(srv.base_url + "/v1/completions", data=json.dumps(
            {"prompt": "x", "max_tokens": 1}).encode(), headers={"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(req, timeout=30)
        assert err.value.code == 503 and err.value.headers["Retry-After"], err.value
        assert "max_num_queued_tokens=1" in json.loads(err.value.read())["error"]["message"]
        stop_running.set()  # the first client leaves: its request is aborted and the queued one runs
        first.join(30)
        second.join(60)
        texts = [line for _, line in queued]
        assert texts[-1] == "data: [DONE]" and any('"content"' in t for t in texts), texts
    finally:
        code = srv.stop()
    log = "\n".join(srv.log)
    assert code == 0, log[-3000:]
    access = [line for line in srv.log if "ferrox.access" in line]
    assert any('"POST /v1/chat/completions" 200' in line for line in access), access
    assert any('"POST /v1/completions" 503' in line for line in access), access
    assert not any("/health" in line or "/metrics" in line for line in access), access
    assert "(streaming delta): choice 0:" in log
