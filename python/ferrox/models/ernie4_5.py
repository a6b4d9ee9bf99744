"""ERNIE 4.5 dense (baidu/ERNIE-4.5-0.3B-PT: Ernie4_5ForCausalLM), as transformers' Ernie4_5 defines it: the Llama
decoder with two differences --

- `use_bias` puts a bias on every projection (q, k, v, o and the MLP's), where Llama's config names them apart;
- rotary in the INTERLEAVED layout (dims 2i, 2i + 1 pair, as GLM's): each head's q and k rows (weights and biases)
  are reordered while loading into ferrox's half-split pairs (models/glm4.py interleaved_rotary_order), so every
  kernel rotates whole heads as for Llama; q . k is unchanged by the same permutation of both.

Every Llama device path follows (fused one-token kernels, tensor parallelism, quantization at load, LoRA with the
adapters' q/k rows permuted as the weights': models/glm4.py InterleavedRotaryRows.lora_rewrite). Refused by name: a
checkpoint quantization_config. GGUF files load dequantized (loader/gguf_families.py).
"""

from __future__ import annotations

import dataclasses

import torch

from ferrox.model_spec import ModelSpec, UnsupportedModelError
from ferrox.models.glm4 import InterleavedRotaryRows, interleaved_rotary_setup
from ferrox.models.llama import LlamaForCausalLM


def ernie_spec(spec: ModelSpec) -> ModelSpec:
    """The spec with ERNIE's one `use_bias` as Llama's attention_bias and mlp_bias."""
    config = spec.hf_config
    for key in ("attention_bias", "mlp_bias"):
        if key in config and bool(config[key]) != bool(config.get("use_bias", False)):
            raise UnsupportedModelError(f"config.json: {key} {config[key]!r} differs from use_bias "
                                        f"{config.get('use_bias')!r}; {spec.architecture} takes use_bias for every "
                                        "projection")
    bias = bool(config.get("use_bias", False))
    return dataclasses.replace(spec, attention_bias=bias, mlp_bias=bias)


class Ernie4_5ForCausalLM(InterleavedRotaryRows, LlamaForCausalLM):
    supports_quantized_gguf = False  # (a GGUF file loads dequantized: loader/gguf_families.py)

    def __init__(self, spec: ModelSpec, dtype: torch.dtype, device: torch.device | str, *,
                 kernels: str | None = None):
        spec = ernie_spec(spec)
        order = interleaved_rotary_setup(spec)
        super().__init__(spec, dtype, device, kernels=kernels)
        self.rotary_order = order


__all__ = ["Ernie4_5ForCausalLM", "ernie_spec"]
