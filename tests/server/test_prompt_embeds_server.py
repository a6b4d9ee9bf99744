"""/v1/completions' prompt_embeds over HTTP (`ferrox serve --enable-prompt-embeds` on a tiny Llama): base64 of
torch.save bytes, one string or a list, through raw HTTP and the openai client's extra_body, gives the tokens
the same prompt's token ids give; embeddings prompts come first, then the text ones; vLLM's refusals (echo,
prompt_logprobs) and bad tensors are 400s naming the field while another request completes; without the flag
(the session's server) prompt_embeds is refused naming it."""

from __future__ import annotations

import base64
import io
import threading
import urllib.request

import pytest
import torch

from tests.helpers.tiny_models import make_tiny_llama
from tests.server.server_proc import ServerProcess
from tests.server.server_proc import post_json as _post

openai = pytest.importorskip("openai")
transformers = pytest.importorskip("transformers")
COMPLETIONS = "/v1/completions"


def _b64(obj) -> str:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return base64.b64encode(buf.getvalue()).decode()


@pytest.fixture(scope="module")
def embeds_server(tmp_path_factory):
    folder = make_tiny_llama(tmp_path_factory.mktemp("llama"))
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()
    srv = ServerProcess(folder, "--served-model-name", "tiny", "--dtype", "float32", "--enable-prompt-embeds",
                        "--max-num-batched-tokens", "16")
    try:
        yield srv, hf
    finally:
        srv.stop()


def _embeds(hf, ids):
    with torch.no_grad():
        return hf.get_input_embeddings()(torch.tensor(ids))


def _body(**fields):
    return {"model": "tiny", "max_tokens": 6, "temperature": 0, "ignore_eos": True, "return_token_ids": True,
            **fields}


def test_embeddings_over_raw_http_and_the_openai_client(embeds_server):
    srv, hf = embeds_server
    ids_a, ids_b = list(range(40, 63)), [7, 99, 120, 3, 56]  # 23 rows: cut by the 16-token step budget
    status, by_ids = _post(srv.base_url, _body(prompt=[ids_a, ids_b]), COMPLETIONS)
    assert status == 200, by_ids
    want = [c["token_ids"] for c in sorted(by_ids["choices"], key=lambda c: c["index"])]
    # A list of embeddings and a text prompt: embeddings first (vLLM's order), then the text.
    status, resp = _post(srv.base_url, _body(prompt_embeds=[_b64(_embeds(hf, ids_a)), _b64(_embeds(hf, ids_b))],
                                             prompt="Hello"), COMPLETIONS)
    assert status == 200, resp
    choices = sorted(resp["choices"], key=lambda c: c["index"])
    assert [c["token_ids"] for c in choices[:2]] == want and len(choices) == 3
    assert choices[0]["prompt_token_ids"] is None and choices[2]["prompt_token_ids"]
    assert resp["usage"]["prompt_tokens"] == len(ids_a) + len(ids_b) + len(choices[2]["prompt_token_ids"])
    # One string, no prompt (a [1, L, hidden] tensor: squeezed).
    status, one = _post(srv.base_url, _body(prompt_embeds=_b64(_embeds(hf, ids_b).unsqueeze(0))), COMPLETIONS)
    assert status == 200 and one["choices"][0]["token_ids"] == want[1], one
    client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="x")
    # vLLM's example saves the embedding layer's output as it comes: a tensor that requires grad.
    with_grad = hf.get_input_embeddings()(torch.tensor(ids_a))
    assert with_grad.requires_grad
    r = client.completions.create(model="tiny", prompt="", max_tokens=6, temperature=0,
                                  extra_body={"prompt_embeds": _b64(with_grad), "ignore_eos": True})
    assert len(r.choices) == 1 and r.choices[0].text == by_ids["choices"][0]["text"]
    stream = client.completions.create(model="tiny", prompt="", max_tokens=6, temperature=0, stream=True,
                                       extra_body={"prompt_embeds": _b64(_embeds(hf, ids_a)), "ignore_eos": True})
    assert "".join(c.choices[0].text for c in stream if c.choices) == r.choices[0].text


@pytest.mark.parametrize(("fields", "param", "message"), [
    ({"prompt_embeds": "not base64!"}, "prompt_embeds", "base64"),
    ({"prompt_embeds": _b64({"a": torch.zeros(2)})}, "prompt_embeds", "not a tensor"),
    ({"prompt_embeds": _b64(torch.zeros(3, 32))}, "prompt_embeds", "hidden size 32"),
    ({"prompt_embeds": _b64(torch.full((3, 64), float("inf")))}, "prompt_embeds", "infinite"),
    ({"prompt_embeds": _b64(torch.ones(3, 64, dtype=torch.int32))}, "prompt_embeds", "Int values"),
    ({"prompt_embeds": _b64(torch.zeros(0, 64))}, "prompt_embeds", "empty"),
    ({"prompt_embeds": _b64(torch.zeros(2000, 64))}, "prompt_embeds", "2000"),
    ({"prompt_embeds": _b64(torch.zeros(3, 64)), "echo": True}, "echo", "echo"),
    ({"prompt_embeds": _b64(torch.zeros(3, 64)), "prompt_logprobs": 1}, "prompt_logprobs", "prompt_logprobs"),
    ({"prompt_embeds": []}, None, "prompt_embeds"),
])
def test_bad_requests_are_400s_naming_the_field_while_others_run(embeds_server, fields, param, message):
    srv, hf = embeds_server
    other: list[tuple[int, dict]] = []

    def run_other() -> None:  # a good request in flight beside the bad one
        other.append(_post(srv.base_url, _body(prompt="The quick brown fox", max_tokens=24), COMPLETIONS))

    worker = threading.Thread(target=run_other)
    worker.start()
    status, resp = _post(srv.base_url, _body(**fields), COMPLETIONS)
    worker.join()
    assert status == 400, resp
    assert message in resp["error"]["message"]
    if param is not None:
        assert resp["error"]["param"] == param, resp
    (other_status, other_resp), = other
    assert other_status == 200 and other_resp["choices"][0]["finish_reason"] == "length"
    # Nothing of the refused request stays in the engine: no running request, no KV block held.
    with urllib.request.urlopen(srv.base_url + "/metrics", timeout=10) as r:
        gauges = {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in r.read().decode().splitlines()
                  if line.startswith(("ferrox:num_requests_running", "ferrox:kv_cache_usage_perc"))}
    assert gauges == {"ferrox:num_requests_running": 0.0, "ferrox:kv_cache_usage_perc": 0.0}


def test_without_the_flag_prompt_embeds_is_refused(base_url):
    status, resp = _post(base_url, {"prompt": "", "max_tokens": 2, "prompt_embeds": _b64(torch.zeros(3, 576))},
                         COMPLETIONS)
    assert status == 400 and resp["error"]["param"] == "prompt_embeds"
    assert "--enable-prompt-embeds" in resp["error"]["message"]
