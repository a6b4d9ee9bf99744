"""Back-pressure on a live `ferrox serve`: the in-flight bound (--max-num-queued-reqs) answers 503 with
Retry-After at once, --request-timeout aborts a request and frees its KV blocks, and a client that
stops reading (--stream-stall-timeout) is dropped without stalling anyone else."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
import typing
import urllib.error
import urllib.request
from typing import Any

import pytest

from tests.server.server_proc import ServerProcess

# LONG outlives TIMEOUT_S at any speed the CPU model reaches (2800 tokens at 100+ tok/s take 28 s).
LONG = {"prompt": "Once upon a time", "max_tokens": 2800, "ignore_eos": True}
TIMEOUT_S = 16
# ~2,300 tokens of SmolLM2's vocabulary that no other test sends (no prefix-cache hit): its prefill takes
# seconds on the CPU (in chunks: the fixture's step budget).
LONG_PROMPT = " ".join(f"w{i}" for i in range(600))


def post(base: str, path: str, body: dict[str, Any], timeout: float = 60) -> tuple[int, dict[str, str], Any]:
    req = urllib.request.Request(base + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, dict(resp.headers), json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), json.loads(exc.read())


def metrics(base: str) -> dict[str, float]:
    with urllib.request.urlopen(base + "/metrics", timeout=10) as resp:
        lines = resp.read().decode().splitlines()
    out: dict[str, float] = {}
    for line in lines:
        if line.startswith("ferrox:") and " " in line:
            name, value = line.split("{")[0].split(" ")[0], float(line.rsplit(" ", 1)[1])
            out[name] = out.get(name, 0.0) + value
    return out


def wait_until(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


def wait_idle(base: str, timeout: float = 15) -> None:
    """Nothing running or waiting and every KV block back (what a leak would break)."""
    def idle() -> bool:
        m = metrics(base)
        return (m["ferrox:num_requests_running"], m["ferrox:num_requests_waiting"], m["ferrox:kv_cache_usage_perc"]) \
            == (0, 0, 0)
    wait_until(idle, timeout, f"server not idle: {metrics(base)}")


class Stream(threading.Thread):
    """A streaming completion read in the background: its data lines, and when the first came."""

    def __init__(self, base: str, body: dict[str, Any]) -> None:
        super().__init__(daemon=True)
        self.base, self.body = base, body
        self.lines: list[str] = []
        self.status = 0
        self.error: Any = None  # the body of an error answered before the stream began
        self.first = threading.Event()
        self.start()

    def run(self) -> None:
        req = urllib.request.Request(self.base + "/v1/completions", json.dumps({**self.body, "stream": True}).encode(),
                                     {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=120) as resp:
                self.status = resp.status
                for raw in resp:
                    if raw.startswith(b"data: "):
                        self.lines.append(raw.decode().strip()[6:])
                        self.first.set()
        except urllib.error.HTTPError as exc:
            self.status, self.error = exc.code, json.loads(exc.read())
        self.first.set()


@pytest.fixture(scope="module")
def limited():
    # One sequence runs at a time, two may be in flight, and none may run longer than TIMEOUT_S: long enough
    # that on a slow box the running request is still in flight when the third arrives (4 s was not, and
    # once 8 s was not: a busy CI box took that long to report the second request waiting).
    # A 256-token step budget cuts LONG_PROMPT's prefill into ~9 short steps: an abort lands between two of them
    # (in one 2,300-token step it waited out the whole step, past wait_idle's timeout on a busy CI box).
    srv = ServerProcess("--max-num-seqs", "1", "--max-num-queued-reqs", "2", "--request-timeout", str(TIMEOUT_S),
                        "--max-model-len", "2900", "--max-num-batched-tokens", "256")
    post(srv.base_url, "/v1/completions", {"prompt": "warm up", "max_tokens": 2})  # the first step is slow
    yield srv
    assert srv.stop() == 0


def test_queue_bound_503_then_timeouts_free_everything(limited):
    base = limited.base_url
    # The waiting request is sent once the running one streams, so the running one's deadline comes first.
    # When it is aborted the waiting one is admitted moments before its own deadline; a ~2,300-token prompt
    # keeps it in prefill (seconds on the CPU) past that deadline, so it ends as a 504 before its stream
    # began. (Sent together with a short prompt, the waiting one sometimes streamed a token in that gap:
    # a CI failure, status 200 with an in-band timeout.)
    sent = time.monotonic()
    running = Stream(base, LONG)
    wait_until(lambda: running.first.is_set(), 30, "the first stream never started")
    waiting = Stream(base, {"prompt": LONG_PROMPT, "max_tokens": 8})
    wait_until(lambda: metrics(base)["ferrox:num_requests_waiting"] == 1, 10, "the second request never waited")
    started = time.monotonic()
    status, headers, body = post(base, "/v1/completions", {"prompt": "Hi", "max_tokens": 2})
    assert status == 503, (f"{started - sent:.1f} s after the two streams were sent", body)
    assert time.monotonic() - started < 2, "the refusal should not wait for capacity"
    assert int(headers["Retry-After"]) >= 1
    assert body["error"]["code"] == "server_overloaded" and "max_num_queued_reqs=2" in body["error"]["message"]
    # Both hit --request-timeout: the running one mid-stream (an in-band error, then [DONE]), the one
    # still waiting before its stream began (a plain 504).
    running.join(30)
    waiting.join(30)
    assert not running.is_alive() and running.lines[-1] == "[DONE]", running.lines[-2:]
    in_band = json.loads(running.lines[-2])["error"]
    assert waiting.status == 504 and not waiting.lines, (waiting.status, waiting.lines[-2:])
    for error in (in_band, waiting.error["error"]):
        assert error["code"] == "request_timeout" and f"request timeout ({TIMEOUT_S} s)" in error["message"], error
    wait_idle(base, timeout=30)
    status, _, body = post(base, "/v1/completions", {"prompt": "Hi", "max_tokens": 2})
    assert status == 200, body  # the in-flight count came back down


def test_request_timeout_without_a_stream_is_a_504(limited):
    base = limited.base_url
    started = time.monotonic()
    status, _, body = post(base, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                                                          "max_tokens": 2800, "ignore_eos": True})
    assert status == 504, body
    assert TIMEOUT_S - 0.5 < time.monotonic() - started < TIMEOUT_S + 8
    assert "request timeout" in body["error"]["message"]
    wait_idle(base)


def test_a_client_that_stops_reading_is_dropped():
    """--stream-stall-timeout on a real socket. Filling a live server's socket buffers takes megabytes
    (Linux grows them to 4 MiB on loopback), more than the CPU model makes in a CI-sized test, so this
    serves the route helpers (start_sse/send_sse) from an in-process aiohttp server whose socket buffer
    is small. Dropping the connection cancels the handler exactly as a client disconnect does, which
    closes the request's generator and aborts it in the engine (tests/server/test_metrics_disconnect.py)."""
    asyncio.run(_stall_case())


async def _stall_case() -> None:
    from aiohttp import web
    from ferrox.entrypoints.openai.serving import CTX, ServerOptions, ServingContext, send_sse, start_sse

    outcome: dict[str, Any] = {}

    async def endless(request: web.Request) -> web.StreamResponse:
        resp = await start_sse(request)
        try:
            while True:
                await send_sse(resp, {"chunk": "x" * 8192})
                outcome["sent"] = outcome.get("sent", 0) + 1
        except asyncio.CancelledError:
            outcome["cancelled_at"] = time.monotonic()
            raise

    async def hello(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application()
    app[CTX] = ServingContext(typing.cast(Any, None), "test", ServerOptions(stream_stall_timeout=0.5))
    app.router.add_get("/stream", endless)
    app.router.add_get("/hello", hello)
    runner = web.AppRunner(app, handler_cancellation=True)
    await runner.setup()
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8192)  # inherited by accepted connections
    listener.bind(("127.0.0.1", 0))
    await web.SockSite(runner, listener).start()
    port = listener.getsockname()[1]
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        writer.write(b"GET /stream HTTP/1.1\r\nHost: x\r\n\r\n")
        started = time.monotonic()
        while "cancelled_at" not in outcome:  # the client reads nothing
            assert time.monotonic() - started < 10, outcome
            await asyncio.sleep(0.05)
        # Blocked writes were given 0.5 s, then the handler was cancelled (not left waiting forever).
        assert 0.4 < outcome["cancelled_at"] - started < 5, outcome
        assert outcome["sent"] < 1000, outcome  # bounded by the buffers, not by the client's patience
        # The connection is closed: what the client reads ends (after what was buffered).
        async def drain() -> None:
            while await reader.read(65536):
                pass
        await asyncio.wait_for(drain(), 5)
        # Other clients are served as usual.
        r2, w2 = await asyncio.open_connection("127.0.0.1", port)
        w2.write(b"GET /hello HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        assert (await asyncio.wait_for(r2.read(), 5)).endswith(b"ok")
        w2.close()
        writer.close()
    finally:
        await runner.cleanup()
