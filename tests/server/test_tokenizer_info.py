"""GET /tokenizer_info's body against vLLM's rule applied to transformers' own tokenizer of the same folder
(its init_kwargs without file paths, added tokens as their text, plus the class and the template)."""

from __future__ import annotations

import json
import os

import pytest
from ferrox.entrypoints.openai.serving_tokenizer_info import tokenizer_info
from ferrox.loader.source import ModelSource
from ferrox.loader.tokenizer import load_tokenizer

from tests.helpers.tiny_models import _write_tokenizer, build_tokenizer


def _vllm_rule(hf) -> dict:
    def plain(v):
        if hasattr(v, "content"):
            return v.content
        if isinstance(v, dict):
            return {k: plain(x) for k, x in v.items()}
        if isinstance(v, list):
            return [plain(x) for x in v]
        return v

    config = {k: plain(v) for k, v in dict(hf.init_kwargs).items() if k not in ("vocab_file", "merges_file")}
    config["tokenizer_class"] = type(hf).__name__
    return config


def test_tokenizer_info_follows_transformers(tmp_path):
    transformers = pytest.importorskip("transformers")
    folder = str(tmp_path)
    _write_tokenizer(folder, build_tokenizer())  # the tiny models' tokenizer files (no weights needed)
    # An added-token entry and a special token written as AddedToken objects, as transformers saves them.
    path = os.path.join(folder, "tokenizer_config.json")
    with open(path, encoding="utf-8") as f:
        config = json.load(f)
    config["eos_token"] = {"__type": "AddedToken", "content": "<|im_end|>", "lstrip": False, "normalized": False,
                           "rstrip": False, "single_word": False, "special": True}
    config["added_tokens_decoder"] = {"0": {"content": "<|endoftext|>", "lstrip": False, "normalized": False,
                                            "rstrip": False, "single_word": False, "special": True}}
    with open(path, "w", encoding="utf-8") as f:
        json.dump(config, f)
    source = ModelSource(folder, "hf", "tiny")
    ours = tokenizer_info(load_tokenizer(source), None)
    reference = _vllm_rule(transformers.AutoTokenizer.from_pretrained(folder))
    # (transformers' class name depends on its version; the folder declares the one any version loads)
    assert ours["tokenizer_class"] == config["tokenizer_class"]
    for key in ("eos_token", "bos_token", "pad_token", "unk_token", "model_max_length", "chat_template"):
        assert ours[key] == reference[key], key
    assert ours["added_tokens_decoder"] == {"0": "<|endoftext|>"} == {
        str(k): v for k, v in reference["added_tokens_decoder"].items()}
    # The server's own --chat-template wins.
    assert tokenizer_info(load_tokenizer(source), "{{ x }}")["chat_template"] == "{{ x }}"
