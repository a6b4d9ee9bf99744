"""The `ferrox` console script: help text covers every flag; a bad model fails fast and loudly."""

from __future__ import annotations

import subprocess

from tests.server.server_proc import FERROX, ROOT

SERVE_FLAGS = (
    "--host", "--port", "--served-model-name", "--api-key", "--max-model-len", "--max-num-seqs",
    "--max-num-batched-tokens", "--gpu-memory-utilization", "--kv-cache-memory", "--dtype", "--load-format",
    "--device", "--block-size", "--disable-prefix-caching", "--enforce-eager", "--chat-template", "--seed",
    "--max-request-body-bytes", "--log-level",
)


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(FERROX), *args], cwd=ROOT, capture_output=True, text=True, timeout=60)


def test_help():
    top = run("--help")
    assert top.returncode == 0 and "serve" in top.stdout
    serve = run("serve", "--help")
    assert serve.returncode == 0
    for flag in SERVE_FLAGS:
        assert flag in serve.stdout, flag
    assert "FERROX_API_KEY" in serve.stdout


def test_bad_model_path_exits_non_zero():
    res = run("serve", "/nonexistent/model-dir", "--port", "0")
    assert res.returncode != 0
    assert "/nonexistent/model-dir" in res.stderr


def test_bad_flag_value_exits_non_zero():
    res = run("serve", "--kv-cache-memory", "lots")
    assert res.returncode != 0 and "kv-cache-memory" in res.stderr
    res = run("serve", "--block-size", "-3")
    assert res.returncode != 0 and "block_size" in res.stderr


def test_engine_startup_failure_is_reported(tmp_path):
    # Passes the front-end's path checks, fails inside the engine-core process: the CLI must
    # relay the core's error and exit non-zero (no hang, no orphan).
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"this is not a gguf file")
    res = run("serve", str(broken), "--port", "0")
    assert res.returncode == 1
    assert "error" in res.stderr.lower() and "gguf" in res.stderr.lower(), res.stderr[-2000:]
