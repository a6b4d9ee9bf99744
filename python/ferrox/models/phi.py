"""Phi-1 / Phi-1.5 / Phi-2 (microsoft/phi-1, phi-1_5, phi-2: PhiForCausalLM), as transformers' Phi defines it:

- one LayerNorm (with bias) a layer, attention and MLP in parallel from it: h = h + attn(ln(h)) + mlp(ln(h));
- q/k/v and the output projection (`dense`) with biases; partial rotary (`partial_rotary_factor`, 0.4 in the
  releases; half-split pairs over the rotating dims, rows reordered at load: layers/rotary.py partial_rotary_order);
- an ungated GELU MLP fc1 -> gelu_new -> fc2 with biases (models/ungated_mlp.py);
- a final LayerNorm and an LM head with a bias (added to the gathered logits).

Decoding takes the general path. Tensor parallelism comes with Llama's projections. Refused by name: `qk_layernorm`,
another hidden_act. GGUF files (llama.cpp's "phi2") load dequantized (loader/gguf_families.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from ferrox.attention.backend import AttentionBackend
from ferrox.layers.ops import DeviceOps
from ferrox.layers.rotary import RotaryEmbedding, partial_rotary_order
from ferrox.model_spec import ModelSpec, UnsupportedModelError
from ferrox.models.glm4 import reorder_rotary_rows
from ferrox.models.gpt_neox import _GELU, BiasedLayerNorm, check_gelu, renamed
from ferrox.models.layer_stack import PerLayerRopeStack
from ferrox.models.llama import LlamaAttention, LlamaForCausalLM
from ferrox.models.ungated_mlp import UngatedMLP

_RENAMES = (("model.final_layernorm.", "model.norm."), (".self_attn.dense.", ".self_attn.o_proj."),
            (".mlp.fc1.", ".mlp.up_proj."), (".mlp.fc2.", ".mlp.down_proj."), ("lm_head.bias", "lm_head_bias"))


class PhiLayer(nn.Module):
    def __init__(self, spec: ModelSpec, backend: AttentionBackend, ops: DeviceOps, dtype: torch.dtype,
                 device: torch.device | str, *, window: int, eps: float):
        super().__init__()
        self.input_layernorm = BiasedLayerNorm(spec.hidden_size, eps, dtype, device)
        self.self_attn = LlamaAttention(spec, backend, ops, dtype, device, qkv_bias=True, o_bias=True, qk_norm=False,
                                        window=window)
        self.mlp = UngatedMLP(spec, nn.GELU(approximate=_GELU[spec.hidden_act]), dtype, device)

    def forward(self, x: torch.Tensor, rope: Any, kv_cache: torch.Tensor, meta: Any) -> torch.Tensor:
        n = self.input_layernorm(x)
        return x + self.self_attn(n, rope, kv_cache, meta) + self.mlp(n)


class PhiModel(PerLayerRopeStack):
    def __init__(self, spec: ModelSpec, backend: AttentionBackend, ops: DeviceOps, dtype: torch.dtype,
                 device: torch.device | str, **_: Any):
        eps = float(spec.hf_config.get("layer_norm_eps", 1e-5))
        layers: list[nn.Module] = [PhiLayer(spec, backend, ops, dtype, device, window=spec.window_of(i), eps=eps)
                                   for i in range(spec.num_layers)]
        super().__init__(spec, backend, dtype, device, layers, BiasedLayerNorm(spec.hidden_size, eps, dtype, device),
                         RotaryEmbedding.for_spec(spec, device, ops))


class PhiForCausalLM(LlamaForCausalLM):
    model_class = PhiModel
    reorders_partial_rotary = True
    supports_quantized_gguf = False  # (a GGUF file loads dequantized: loader/gguf_families.py)

    def __init__(self, spec: ModelSpec, dtype: torch.dtype, device: torch.device | str, *,
                 kernels: str | None = None):
        if spec.hf_config.get("qk_layernorm"):
            raise UnsupportedModelError("config.json: qk_layernorm is not supported for PhiForCausalLM")
        check_gelu(spec)
        spec = dataclasses.replace(spec, attention_bias=True, mlp_bias=True)
        super().__init__(spec, dtype, device, kernels=kernels)
        # (float32: added to the float32 logits, after the tensor-parallel gather)
        self.lm_head_bias = nn.Parameter(torch.zeros(spec.vocab_size, dtype=torch.float32, device=device),
                                         requires_grad=False)
        self.rotary_order = (None if spec.rotary_dim is None else
                             partial_rotary_order(spec.head_dim, spec.rotary_dim))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return super().compute_logits(hidden) + self.lm_head_bias

    def _hf_names(self, weights: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
        for name, tensor in weights:
            yield renamed(name, _RENAMES), tensor

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        super().load_weights(self.lora_rewrite(weights))

    def lora_rewrite(self, pairs: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
        """The checkpoint's names and q/k row order (partial rotary): the load path, row-only, so an adapter's
        (module.weight, lora_B) pairs take it too (lora/rewrite.py)."""
        return reorder_rotary_rows(self._hf_names(pairs), self.spec.head_dim, self.rotary_order)


__all__ = ["PhiForCausalLM"]
