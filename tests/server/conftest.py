"""One `ferrox serve` on the embedded model for the whole server test session (startup dominates
the cost on the 2-core CI box); tests that need other flags start their own."""

from __future__ import annotations

import signal
import time

import pytest

from tests.server.server_proc import ServerProcess, pid_alive

MAX_MODEL_LEN = 1024
BODY_LIMIT = 256 * 1024


@pytest.fixture(scope="session")
def server():
    srv = ServerProcess("--max-request-body-bytes", str(BODY_LIMIT), "--served-model-name", "smol")
    yield srv
    # Ctrl-C must stop the server cleanly: exit code 0, and no orphaned engine-core process.
    code = srv.stop(signal.SIGINT)
    assert code == 0, "\n".join(srv.log[-30:])
    assert srv.core_pid is not None
    deadline = time.monotonic() + 5
    while pid_alive(srv.core_pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not pid_alive(srv.core_pid), "engine core process outlived the server"


@pytest.fixture(scope="session")
def base_url(server) -> str:
    return server.base_url
