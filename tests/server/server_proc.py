"""Start a real `ferrox serve` subprocess on a free loopback port and wait until it is ready."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
FERROX = Path(sys.executable).with_name("ferrox")

# Small and quick to start on the 2-core CI box: a 128 MiB KV cache holds tens of thousands of
# tokens of SmolLM2-135M, more than the tests use at once.
DEFAULT_ARGS = ["--max-model-len", "1024", "--kv-cache-memory", "128MiB", "--log-level", "info"]


def post_json(base_url: str, body: dict, path: str = "/v1/chat/completions") -> tuple[int, dict]:
    """(HTTP status, the JSON answer) of a POST, error statuses included (raw HTTP: no client package)."""
    req = urllib.request.Request(base_url + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead for our purposes.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


class ServerProcess:
    def __init__(self, *extra_args: str, env: dict[str, str] | None = None, startup_timeout: float = 240.0) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        cmd = [str(FERROX), "serve", "--port", str(self.port), *DEFAULT_ARGS, *extra_args]
        self.log: list[str] = []
        self.core_pid: int | None = None
        self.proc = subprocess.Popen(
            cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env={**os.environ, **(env or {})},
        )
        self._ready = threading.Event()
        self._reader = threading.Thread(target=self._read_log, daemon=True)
        self._reader.start()
        deadline = time.monotonic() + startup_timeout
        while not self._ready.wait(0.2):
            if self.proc.poll() is not None:
                self._reader.join(2)
                raise RuntimeError(f"ferrox serve exited with {self.proc.returncode}:\n" + "\n".join(self.log))
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("ferrox serve did not become ready:\n" + "\n".join(self.log))
        self.wait_healthy()

    def _read_log(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.log.append(line.rstrip())
            match = re.search(r"engine core pid (\d+)", line)
            if match:
                self.core_pid = int(match.group(1))
            if "serving on http://" in line:
                self._ready.set()

    def wait_healthy(self, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                with urllib.request.urlopen(self.base_url + "/health", timeout=2) as resp:
                    if resp.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("server never became healthy:\n" + "\n".join(self.log))
            time.sleep(0.1)

    def stop(self, sig: int = signal.SIGINT, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self._reader.join(5)
        return self.proc.returncode


def openai_client(server: ServerProcess) -> Any:
    """The `openai` package's client for `server` (no retries, 120 s a call): `with openai_client(srv) as c:`."""
    import openai

    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def served_openai_client(*args: str) -> Iterator[Any]:
    """For a module fixture: `yield from served_openai_client(folder, flags...)` starts `ferrox serve`, yields an
    `openai_client` for it and, after the module, stops it, asserting a clean exit (its log's tail if not)."""
    server = ServerProcess(*args)
    try:
        with openai_client(server) as client:
            yield client
    finally:
        assert server.stop() == 0, "\n".join(server.log[-30:])
