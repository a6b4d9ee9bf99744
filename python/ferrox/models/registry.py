"""Model classes by the `architectures` name of config.json."""

from __future__ import annotations

import importlib

from ferrox.loader.errors import UnsupportedModelError

# name -> "module:Class", imported on first use so listing support stays cheap.
SUPPORTED: dict[str, str] = {
    "LlamaForCausalLM": "ferrox.models.llama:LlamaForCausalLM",
    "MistralForCausalLM": "ferrox.models.llama:MistralForCausalLM",
    "Qwen2ForCausalLM": "ferrox.models.qwen:Qwen2ForCausalLM",
    "Qwen3ForCausalLM": "ferrox.models.qwen:Qwen3ForCausalLM",
}


def get_model_class(architectures: list[str]) -> type:
    for arch in architectures:
        target = SUPPORTED.get(arch)
        if target is not None:
            module, _, cls = target.partition(":")
            return getattr(importlib.import_module(module), cls)
    raise UnsupportedModelError(
        f"architecture {architectures!r} is not supported; supported architectures: {', '.join(sorted(SUPPORTED))}"
    )
