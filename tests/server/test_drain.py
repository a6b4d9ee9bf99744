"""Graceful drain with real signals: SIGTERM under --shutdown-timeout refuses new requests (503,
/health 503 "draining") while running ones finish, aborts what is left when the timeout passes, and
exits 0; a second signal stops waiting at once."""

from __future__ import annotations

import json
import signal
import time

from tests.server.server_proc import ServerProcess, pid_alive
from tests.server.test_backpressure import Stream, post


def _health(base: str) -> tuple[int, str]:
    import urllib.error
    import urllib.request
    try:
        with urllib.request.urlopen(base + "/health", timeout=5) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def _exit_code(srv: ServerProcess, timeout: float) -> int | None:
    try:
        return srv.proc.wait(timeout)
    except Exception:
        return None


def test_sigterm_lets_a_running_stream_finish_and_refuses_new_requests():
    srv = ServerProcess("--shutdown-timeout", "60")
    stream = Stream(srv.base_url, {"prompt": "Once upon a time", "max_tokens": 40, "ignore_eos": True})
    assert stream.first.wait(60) and stream.lines, "the stream never started"
    srv.proc.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    status, headers, body = post(srv.base_url, "/v1/completions", {"prompt": "Hi", "max_tokens": 2})
    assert status == 503 and "Retry-After" in headers, body
    assert body["error"]["code"] == "server_shutting_down"
    assert _health(srv.base_url)[0] == 503 and "draining" in _health(srv.base_url)[1]
    stream.join(60)
    assert stream.lines[-1] == "[DONE]"
    last = json.loads(stream.lines[-2])
    assert last["choices"][0]["finish_reason"] == "length", last  # finished, not aborted
    assert _exit_code(srv, 30) == 0, "\n".join(srv.log[-20:])
    assert any("drained" in line for line in srv.log)
    srv.stop()


def test_requests_left_at_the_shutdown_timeout_are_aborted_with_a_clear_error():
    srv = ServerProcess("--shutdown-timeout", "1")
    stream = Stream(srv.base_url, {"prompt": "Once upon a time", "max_tokens": 900, "ignore_eos": True})
    assert stream.first.wait(60), "the stream never started"
    started = time.monotonic()
    srv.proc.send_signal(signal.SIGTERM)
    assert _exit_code(srv, 20) == 0, "\n".join(srv.log[-20:])
    assert time.monotonic() - started < 15
    stream.join(10)
    assert stream.lines[-1] == "[DONE]"
    error = json.loads(stream.lines[-2])["error"]
    assert "shutdown timeout (1 s)" in error["message"], error
    srv.stop()
    assert srv.core_pid is not None and not pid_alive(srv.core_pid)


def test_a_second_signal_stops_the_drain_at_once():
    srv = ServerProcess("--shutdown-timeout", "120")
    stream = Stream(srv.base_url, {"prompt": "Once upon a time", "max_tokens": 900, "ignore_eos": True})
    assert stream.first.wait(60), "the stream never started"
    srv.proc.send_signal(signal.SIGTERM)
    time.sleep(1.0)
    assert srv.proc.poll() is None, "the first SIGTERM must wait for the running stream"
    started = time.monotonic()
    srv.proc.send_signal(signal.SIGINT)
    assert _exit_code(srv, 15) == 0, "\n".join(srv.log[-20:])
    assert time.monotonic() - started < 10
    stream.join(10)
    assert stream.lines[-1] == "[DONE]" and "error" in json.loads(stream.lines[-2]), stream.lines[-2:]
    srv.stop()
