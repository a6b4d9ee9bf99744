"""Start-up fails fast and says what it is doing: a taken port is reported before the model loads,
a KV cache that cannot hold one max_model_len request is refused naming both numbers and the flags,
and `LLM()` logs one line per loading phase with a progress bar for the weights."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import time

from tests.server.server_proc import FERROX, ROOT


def test_taken_port_fails_before_the_model_loads():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        started = time.monotonic()
        res = subprocess.run([str(FERROX), "serve", "--port", str(port), "--log-level", "info"], cwd=ROOT,
                             capture_output=True, text=True, timeout=60)
        elapsed = time.monotonic() - started
    assert res.returncode == 1, res.stderr[-2000:]
    assert f"cannot listen on 127.0.0.1:{port}" in res.stderr
    assert "loading the weights" not in res.stderr and elapsed < 15, (elapsed, res.stderr[-2000:])


def test_kv_cache_smaller_than_max_model_len_is_refused():
    res = subprocess.run([str(FERROX), "serve", "--port", "0", "--kv-cache-memory", "16MiB", "--max-model-len", "2048"],
                         cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert res.returncode == 1
    err = res.stderr
    assert "max_model_len=2048" in err and re.search(r"KV cache holds \d+ tokens", err), err[-2000:]
    assert "--max-model-len" in err and "--kv-cache-memory" in err


_LOAD = """
from ferrox import LLM
llm = LLM(max_model_len=512, kv_cache_memory=32 << 20)
print("LOADED", llm.engine.max_model_len)
"""


def test_llm_logs_each_loading_phase():
    # A script that configured no logging still sees the phases (on stderr), and stdout stays clean.
    res = subprocess.run([sys.executable, "-c", _LOAD], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.strip() == "LOADED 512"
    err = res.stderr
    phases = ["model SmolLM2-135M-Instruct", "loading the tokenizer", "loading the weights", "Loading weights",
              "allocating the KV cache", "KV cache:", "engine ready"]
    positions = [err.find(p) for p in phases]
    assert -1 not in positions and positions == sorted(positions), (positions, err[-3000:])
    assert "tensor/s" in err  # tqdm's bar over the weight tensors
