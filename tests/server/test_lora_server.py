"""Multi-LoRA over HTTP: `ferrox serve --enable-lora --lora-modules`, the `model` field picking an
adapter (official openai client), /v1/models listing adapters, and loading / unloading adapters at
run time while requests run (VLLM_ALLOW_RUNTIME_LORA_UPDATING=true), with bad adapters refused."""

from __future__ import annotations

import concurrent.futures
import json
import urllib.error
import urllib.request

import pytest

from tests.helpers.tiny_models import EOS_TOKEN_ID, make_tiny_llama
from tests.lora.adapters import load_hf_model, make_peft_adapter, merged_reference
from tests.models.conftest import cut_at_eos, hf_greedy
from tests.server.server_proc import ServerProcess

openai = pytest.importorskip("openai")

PROMPT = [1, 17, 42, 99, 7, 300, 12]


@pytest.fixture(scope="module")
def lora_server(tmp_path_factory):
    base_dir = make_tiny_llama(tmp_path_factory.mktemp("base"), hidden_size=64, num_layers=2)
    base = load_hf_model(base_dir)
    folders = {name: make_peft_adapter(base, tmp_path_factory.mktemp(name), r=r, seed=seed)
               for name, r, seed in (("sql", 8, 1), ("chat", 4, 2), ("big", 16, 3))}
    refs = {"base": hf_greedy(base, PROMPT, 10)}
    for name in ("sql", "chat"):
        refs[name] = hf_greedy(merged_reference(base, folders[name]), PROMPT, 10)
    refs = {k: cut_at_eos(v, [EOS_TOKEN_ID]) for k, v in refs.items()}
    srv = ServerProcess(base_dir, "--served-model-name", "tiny", "--enable-lora", "--max-loras", "2",
                        "--max-lora-rank", "8", "--lora-allowed-dirs", str(tmp_path_factory.getbasetemp()),
                        "--lora-modules", f"sql={folders['sql']}", env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "true"})
    try:
        yield srv, folders, refs
    finally:
        srv.stop()


def _post(base_url: str, path: str, body: dict) -> tuple[int, str]:
    req = urllib.request.Request(base_url + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def _tokens(client, model: str, max_tokens: int = 10) -> list[int]:
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=max_tokens, temperature=0,
                                    logprobs=1, extra_body={"return_tokens_as_token_ids": True})
    return [int(t.split(":")[1]) for t in out.choices[0].logprobs.tokens]


def test_adapters_by_name_listing_and_runtime_updates(lora_server):
    srv, folders, refs = lora_server
    client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="x")
    ids = {m.id: m for m in client.models.list().data}
    assert set(ids) == {"tiny", "sql"} and ids["sql"].parent == "tiny"
    assert _tokens(client, "tiny") == refs["base"]
    assert _tokens(client, "sql") == refs["sql"]

    # Load "chat" while a long "sql" request streams; both answer what they answer alone.
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        long_sql = pool.submit(_tokens, client, "sql", 200)
        status, text = _post(srv.base_url, "/v1/load_lora_adapter", {"lora_name": "chat", "lora_path": folders["chat"]})
        assert status == 200, text
        assert _tokens(client, "chat") == refs["chat"]
        # Unload "sql" while its request runs: it finishes with the adapter, later ones get a 404.
        status, text = _post(srv.base_url, "/v1/unload_lora_adapter", {"lora_name": "sql"})
        assert status == 200, text
        assert cut_at_eos(long_sql.result(), [EOS_TOKEN_ID])[:len(refs["sql"])] == refs["sql"]
    with pytest.raises(openai.NotFoundError):
        _tokens(client, "sql")
    assert {m.id for m in client.models.list().data} == {"tiny", "chat"}


def test_bad_adapters_are_refused_by_name(lora_server, tmp_path):
    srv, folders, _ = lora_server
    cases = [
        ({"lora_name": "big", "lora_path": folders["big"]}, "max_lora_rank"),  # rank 16 > 8
        ({"lora_name": "nothing", "lora_path": str(tmp_path)}, "adapter_config.json"),
        ({"lora_name": "chat2"}, "lora_path"),
        ({"lora_path": folders["chat"]}, "lora_name"),
    ]
    for body, field in cases:
        status, text = _post(srv.base_url, "/v1/load_lora_adapter", body)
        assert status == 400 and field in text, (body, status, text, "\n".join(srv.log[-30:]))
    status, text = _post(srv.base_url, "/v1/unload_lora_adapter", {"lora_name": "never-loaded"})
    assert status == 404, text
    # Only folders under --lora-allowed-dirs, after resolving symlinks: nothing else on disk is read.
    escape = tmp_path / "escape"
    escape.symlink_to("/etc")
    for path in ("/etc", str(escape), str(tmp_path / ".." / ".." / ".." / "etc")):
        status, text = _post(srv.base_url, "/v1/load_lora_adapter", {"lora_name": "evil", "lora_path": path})
        assert status == 403 and "lora-allowed-dirs" in text, (path, status, text)
    # Without --trust-request-chat-template a request's own template is refused (vLLM's rule).
    status, text = _post(srv.base_url, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                                "chat_template": "{{ messages }}"})
    assert status == 400 and "chat_template" in text, text
    # The server still serves.
    client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="x")
    assert client.completions.create(model="tiny", prompt=PROMPT, max_tokens=2).choices[0].text is not None


def test_lora_modules_needs_enable_lora(tmp_path):
    with pytest.raises(RuntimeError, match="--lora-modules needs --enable-lora"):
        ServerProcess("--lora-modules", f"x={tmp_path}", startup_timeout=60)


def _lora_info(base_url: str) -> list[dict[str, str]]:
    """The label sets of /metrics' lora_requests_info series (vLLM's gauge; ferrox's default prefix)."""
    import re

    with urllib.request.urlopen(base_url + "/metrics", timeout=30) as resp:
        text = resp.read().decode()
    series = [ln for ln in text.splitlines() if ln.startswith("ferrox:lora_requests_info{")]
    return [dict(re.findall(r'(\w+)="([^"]*)"', ln.split("}")[0])) for ln in series]


def test_metrics_name_the_adapters_in_use(lora_server):
    """vLLM's lora_requests_info (LoRA-aware routers read it): while a request with an adapter runs, its name
    is among the running adapters, with max_lora; once it is done, none is."""
    import time

    srv, folders, _ = lora_server
    status, text = _post(srv.base_url, "/v1/load_lora_adapter", {"lora_name": "big2", "lora_path": folders["chat"]})
    assert status == 200, text
    client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="x")
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        running = pool.submit(client.completions.create, model="big2", prompt=PROMPT, max_tokens=400, temperature=0,
                              extra_body={"ignore_eos": True})
        seen: list[dict[str, str]] = []
        while not running.done() and not any(s.get("running_lora_adapters") == "big2" for s in seen):
            seen = _lora_info(srv.base_url)
            time.sleep(0.02)
        assert any(s.get("running_lora_adapters") == "big2" for s in seen), seen
        assert running.result().choices[0].finish_reason == "length"
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        info = _lora_info(srv.base_url)
        if info and info[0]["running_lora_adapters"] == "":
            break
        time.sleep(0.05)
    assert info == [{"max_lora": "2", "waiting_lora_adapters": "", "running_lora_adapters": ""}], info
