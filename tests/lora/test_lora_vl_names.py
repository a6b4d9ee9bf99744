"""An adapter trained on a whole vision-language model names its text layers under the checkpoint's text-model
prefix (transformers 5's `model.language_model.layers...`, older LLaVA-layout `language_model.model.layers...`):
read as the text model's `model.layers...` (lora/adapter.py text_model_name), as vLLM maps them. The same tensors
under either spelling give the same tokens, different from the base model's; both spellings of one module in one
adapter are refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from ferrox import LLM, SamplingParams
from ferrox.lora.adapter import LoRAAdapterError
from ferrox.lora.request import LoRARequest

from tests.helpers.tiny_models import make_tiny_qwen2_vl
from tests.lora.adapters import write_adapter

PROMPT = {"prompt_token_ids": [5, 6, 7, 8, 9]}
GREEDY = SamplingParams(temperature=0, max_tokens=6)


@pytest.fixture(scope="module")
def vl(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-vl")
    folder = make_tiny_qwen2_vl(root / "vl")
    config = json.loads((Path(folder) / "config.json").read_text())
    hidden = config.get("text_config", config)["hidden_size"]
    llm = LLM(folder, dtype="float32", device="cpu", enable_lora=True, max_loras=2, max_lora_rank=8,
              max_model_len=256, kv_cache_memory=8 << 20)
    yield root, hidden, llm
    llm.engine.shutdown()


def _adapter(root: Path, prefix: str, hidden: int, name: str) -> str:
    modules = {f"{prefix}.layers.{i}.self_attn.{p}": (hidden, hidden) for i in range(2) for p in ("q_proj", "o_proj")}
    return write_adapter(root / name, modules, r=4, seed=1, std=0.3)


def test_text_model_prefixes_adapt_the_text_layers(vl):
    root, hidden, llm = vl
    requests = [LoRARequest(name, i + 1, _adapter(root, prefix, hidden, name)) for i, (name, prefix) in enumerate(
        (("plain", "model"), ("hf5", "model.language_model"), ("llava", "language_model.model")))]
    base = llm.generate(PROMPT, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    outs = [llm.generate(PROMPT, GREEDY, use_tqdm=False, lora_request=r)[0].outputs[0].token_ids for r in requests]
    assert outs[0] != base and outs[1] == outs[0] and outs[2] == outs[0]


def test_two_spellings_of_one_module_are_refused_by_name(vl):
    root, hidden, llm = vl
    both = write_adapter(root / "both", {"model.layers.0.self_attn.q_proj": (hidden, hidden),
                                         "model.language_model.layers.0.self_attn.q_proj": (hidden, hidden)}, r=4)
    with pytest.raises(LoRAAdapterError, match="two spellings of one module"):
        llm.generate(PROMPT, GREEDY, use_tqdm=False, lora_request=LoRARequest("both", 9, both))
    assert llm.generate(PROMPT, GREEDY, use_tqdm=False)[0].outputs[0].token_ids  # (the engine still serves)
