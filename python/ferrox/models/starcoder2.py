"""StarCoder2 (bigcode/starcoder2-3b, -7b, -15b: Starcoder2ForCausalLM), as transformers' Starcoder2 defines it:
GPT-NeoX's sequential layer shape (models/gpt_neox.py: LayerNorms with biases, `norm_epsilon`) over GQA attention with
whole-head rotary and a sliding window where config.json sets one; q/k/v/o and the ungated MLP (c_fc -> GELU tanh ->
c_proj) carry biases when `use_bias` (default on); the LM head tied to the embedding in the releases.

Decoding takes the general path. Tensor parallelism comes with Llama's projections. Refused by name: another
hidden_act. GGUF files load dequantized (loader/gguf_families.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from ferrox.attention.backend import AttentionBackend
from ferrox.layers.ops import DeviceOps
from ferrox.layers.rotary import RotaryEmbedding
from ferrox.model_spec import ModelSpec
from ferrox.models.gpt_neox import _GELU, BiasedLayerNorm, GPTNeoXLayer, check_gelu, renamed
from ferrox.models.layer_stack import PerLayerRopeStack
from ferrox.models.llama import LlamaForCausalLM

_RENAMES = ((".mlp.c_fc.", ".mlp.up_proj."), (".mlp.c_proj.", ".mlp.down_proj."))


class Starcoder2Model(PerLayerRopeStack):
    def __init__(self, spec: ModelSpec, backend: AttentionBackend, ops: DeviceOps, dtype: torch.dtype,
                 device: torch.device | str, **_: Any):
        eps = float(spec.hf_config.get("norm_epsilon", 1e-5))
        layers: list[nn.Module] = [GPTNeoXLayer(spec, backend, ops, dtype, device, window=spec.window_of(i), eps=eps,
                                                parallel=False, act=nn.GELU(approximate=_GELU[spec.hidden_act]))
                                   for i in range(spec.num_layers)]
        super().__init__(spec, backend, dtype, device, layers, BiasedLayerNorm(spec.hidden_size, eps, dtype, device),
                         RotaryEmbedding.for_spec(spec, device, ops))


class Starcoder2ForCausalLM(LlamaForCausalLM):
    model_class = Starcoder2Model
    supports_quantized_gguf = False  # (a GGUF file loads dequantized: loader/gguf_families.py)

    def __init__(self, spec: ModelSpec, dtype: torch.dtype, device: torch.device | str, *,
                 kernels: str | None = None):
        check_gelu(spec)
        bias = bool(spec.hf_config.get("use_bias", True))
        super().__init__(dataclasses.replace(spec, attention_bias=bias, mlp_bias=bias), dtype, device, kernels=kernels)

    def _hf_names(self, weights: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
        for name, tensor in weights:
            yield renamed(name, _RENAMES), tensor

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        super().load_weights(self._hf_names(weights))


__all__ = ["Starcoder2ForCausalLM"]
