"""vLLM's skip_tokenizer_init (loader/no_tokenizer.py): a tiny Llama folder without any tokenizer file serves
token ids in and out -- the same greedy tokens as the engine with its tokenizer, empty text -- offline and over
HTTP, and everything that needs text is refused by name."""

from __future__ import annotations

import os
import shutil

import pytest
from ferrox import LLM, SamplingParams
from ferrox.config import EngineConfig
from ferrox.errors import InvalidArgumentError
from ferrox.structured.params import StructuredOutputsParams

from tests.helpers.tiny_models import make_tiny_llama
from tests.server.server_proc import ServerProcess, post_json

PROMPT = [5, 9, 11, 40, 77]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """(the tiny Llama, the same folder without its tokenizer files)."""
    folder = make_tiny_llama(tmp_path_factory.mktemp("llama") / "m")
    bare = str(tmp_path_factory.mktemp("bare") / "m")
    shutil.copytree(folder, bare)
    for name in os.listdir(bare):
        if name.startswith("tokenizer") or name == "special_tokens_map.json":
            os.remove(os.path.join(bare, name))
    return folder, bare


def test_token_ids_in_and_out_as_with_the_tokenizer(folders):
    folder, bare = folders
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1)
    with_tokenizer = LLM(model=folder, dtype="float32", kv_cache_memory=8 << 20)
    try:
        want = list(with_tokenizer.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False)[0]
                    .outputs[0].token_ids)
    finally:
        with_tokenizer.engine.shutdown()
    llm = LLM(model=bare, dtype="float32", kv_cache_memory=8 << 20, skip_tokenizer_init=True)
    try:
        out = llm.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False)[0].outputs[0]
        assert list(out.token_ids) == want and out.text == ""
        assert all(lp.decoded_token is None for step in out.logprobs for lp in step.values())
        with pytest.raises(InvalidArgumentError, match="skip_tokenizer_init") as err:
            llm.generate(["a text prompt"], params, use_tqdm=False)
        assert err.value.param == "prompt"
        for field, value in (("stop", ["x"]), ("bad_words", ["x"]),
                             ("structured_outputs", StructuredOutputsParams(regex="a+"))):
            with pytest.raises(InvalidArgumentError, match=f"{field}: needs the tokenizer"):
                llm.generate([{"prompt_token_ids": PROMPT}], SamplingParams(max_tokens=2, **{field: value}),
                             use_tqdm=False)
        # stop_token_ids still work: the first greedy token stops the request.
        stopped = llm.generate([{"prompt_token_ids": PROMPT}],
                               SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[want[0]]), use_tqdm=False)
        assert list(stopped[0].outputs[0].token_ids) == [want[0]]
    finally:
        llm.engine.shutdown()
    with pytest.raises(ValueError, match="tokenizer: .* needs the tokenizer"):
        EngineConfig(model=bare, skip_tokenizer_init=True, tokenizer=folder)
    with pytest.raises(ValueError, match="tokenizer_revision: .* needs the tokenizer"):
        EngineConfig(model=bare, skip_tokenizer_init=True, tokenizer_revision="v1")


def test_server_takes_token_ids_and_refuses_text(folders):
    _, bare = folders
    srv = ServerProcess(bare, "--served-model-name", "m", "--skip-tokenizer-init")
    try:
        status, body = post_json(srv.base_url, path="/v1/completions", body={
            "model": "m", "prompt": PROMPT, "max_tokens": 4, "temperature": 0, "logprobs": 0,
            "return_tokens_as_token_ids": True})
        assert status == 200, body
        choice = body["choices"][0]
        assert choice["text"] == "" and len(choice["logprobs"]["tokens"]) == 4, choice
        status, body = post_json(srv.base_url, path="/v1/completions", body={"model": "m", "prompt": "hello", "max_tokens": 2})
        assert status == 400 and body["error"]["param"] == "prompt" and "skip_tokenizer_init" in body["error"]["message"]
        status, body = post_json(srv.base_url, path="/v1/chat/completions", body={
            "model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        assert status == 400 and "skip_tokenizer_init" in body["error"]["message"], body
    finally:
        assert srv.stop() == 0
