"""vLLM's torch-profiler hooks: on only with VLLM_TORCH_PROFILER_DIR; LLM.start_profile / stop_profile
write a Chrome trace of the engine's steps there; the server's POST /start_profile and /stop_profile exist
only with the variable, and POST /reset_prefix_cache only with VLLM_SERVER_DEV_MODE=1 (as in vLLM)."""

from __future__ import annotations

import gzip
import json
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from ferrox import LLM, SamplingParams
from ferrox.errors import InvalidArgumentError

from tests.helpers.tiny_models import make_tiny_llama
from tests.server.server_proc import ServerProcess

PARAMS = SamplingParams(temperature=0, max_tokens=4)


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> str:
    return make_tiny_llama(tmp_path_factory.mktemp("profiler") / "llama")


def _traces(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.pt.trace.json.gz"))


def test_offline_profile_writes_a_trace(folder, tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_TORCH_PROFILER_DIR", str(tmp_path / "traces"))
    llm = LLM(model=folder, kv_cache_memory=8 << 20)
    try:
        llm.start_profile()
        with pytest.raises(InvalidArgumentError, match="already running"):
            llm.start_profile()
        llm.generate(["hello"], PARAMS, use_tqdm=False)
        llm.stop_profile()
        with pytest.raises(InvalidArgumentError, match="not running"):
            llm.stop_profile()
    finally:
        llm.engine.shutdown()
    (trace,) = _traces(tmp_path / "traces")
    events = json.loads(gzip.decompress(trace.read_bytes()))["traceEvents"]
    assert any("aten::" in str(e.get("name", "")) for e in events)  # the model's ops were recorded


def test_profiling_is_off_without_the_variable(folder, monkeypatch):
    monkeypatch.delenv("VLLM_TORCH_PROFILER_DIR", raising=False)
    llm = LLM(model=folder, kv_cache_memory=8 << 20)
    try:
        with pytest.raises(InvalidArgumentError, match="VLLM_TORCH_PROFILER_DIR"):
            llm.start_profile()
    finally:
        llm.engine.shutdown()


def _post(base: str, path: str, body: dict | None = None) -> int:
    req = urllib.request.Request(base + path, json.dumps(body or {}).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status
    except urllib.error.HTTPError as e:
        return e.code


def test_server_routes_follow_the_variables(folder, tmp_path):
    traces = tmp_path / "server-traces"
    srv = ServerProcess(folder, "--max-model-len", "256",
                        env={"VLLM_TORCH_PROFILER_DIR": str(traces), "VLLM_SERVER_DEV_MODE": "1"})
    try:
        assert _post(srv.base_url, "/start_profile") == 200
        assert _post(srv.base_url, "/v1/completions", {"prompt": "hi", "max_tokens": 4}) == 200
        assert _post(srv.base_url, "/stop_profile") == 200
        assert _post(srv.base_url, "/reset_prefix_cache") == 200  # idle: nothing holds a block
    finally:
        assert srv.stop() == 0
    assert len(_traces(traces)) == 1
    plain = ServerProcess(folder, "--max-model-len", "256",
                          env={"VLLM_TORCH_PROFILER_DIR": "", "VLLM_SERVER_DEV_MODE": ""})
    try:
        assert _post(plain.base_url, "/start_profile") == 404
        assert _post(plain.base_url, "/reset_prefix_cache") == 404
    finally:
        assert plain.stop() == 0
