"""One `ferrox serve` on the embedded model for the whole server test session (startup dominates
the cost on the 2-core CI box); tests that need other flags start their own."""

from __future__ import annotations

import http.client
import json
import signal
import threading
import time

import pytest

from tests.server.server_proc import ServerProcess, pid_alive

MAX_MODEL_LEN = 1024
BODY_LIMIT = 256 * 1024


@pytest.fixture(scope="session")
def server():
    # Some tests send their own chat templates (sandboxed); vLLM refuses those without the flag.
    # Two names (vLLM's --served-model-name a b): responses name the first, requests may use either.
    srv = ServerProcess("--max-request-body-bytes", str(BODY_LIMIT), "--served-model-name", "smol", "smol-alias",
                        "--trust-request-chat-template")
    yield srv
    _check_clean_ctrl_c(srv)


def _check_clean_ctrl_c(srv: ServerProcess) -> None:
    """Ctrl-C with a stream in flight: the stream ends (error event or finish, then [DONE]), the
    server exits 0, and no engine-core process is left behind."""
    lines: list[str] = []
    started = threading.Event()

    def stream() -> None:
        conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=60)
        body = {"prompt": "Once upon a time", "max_tokens": 900, "ignore_eos": True, "stream": True}
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        for raw in resp:
            line = raw.decode().strip()
            if line.startswith("data: "):
                lines.append(line[6:])
                started.set()
        started.set()

    reader = threading.Thread(target=stream, daemon=True)
    reader.start()
    assert started.wait(60), "no stream output before Ctrl-C"
    code = srv.stop(signal.SIGINT)
    reader.join(10)
    assert code == 0, "\n".join(srv.log[-30:])
    assert lines[-1] == "[DONE]", lines[-3:]
    last = json.loads(lines[-2])
    assert "error" in last or last["choices"][0]["finish_reason"] is not None, last
    assert srv.core_pid is not None
    deadline = time.monotonic() + 5
    while pid_alive(srv.core_pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not pid_alive(srv.core_pid), "engine core process outlived the server"


@pytest.fixture(scope="session")
def base_url(server) -> str:
    return server.base_url
