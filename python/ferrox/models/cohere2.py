"""Cohere Command R7B / Command A (CohereLabs/c4ai-command-r7b-12-2024, command-a-03-2025: Cohere2ForCausalLM), as
transformers' Cohere2 defines it:

- a parallel block: h = h + attn(n) + mlp(n) with n = input_layernorm(h), one norm a layer;
- Cohere's LayerNorm: mean-centred, scaled by a weight, no bias, in float32 (`layer_norm_eps`), also the final norm;
- sliding-window layers (`layer_types`, else all but every `sliding_window_pattern`-th, default 4) rotate q and k
  with rotary in the INTERLEAVED layout (q/k rows reordered at load into ferrox's half-split pairs, as GLM's:
  models/glm4.py); the full-attention layers take no rotary at all (models/smollm3.py NoRope);
- logits times `logit_scale` (0.0625 / 0.25 in the releases); tied embeddings in the releases.

Decoding takes the general path (the fused one-token kernels run pre-norm RMSNorm layers). Tensor parallelism comes
with Llama's projections. Refused by name: `sliding_window` null (transformers' layers would then rotate nowhere),
`use_qk_norm`, a checkpoint quantization_config and LoRA (the permuted q/k rows), GGUF files.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ferrox.attention.backend import AttentionBackend
from ferrox.layers.ops import DeviceOps, Rope
from ferrox.layers.rotary import RotaryEmbedding
from ferrox.layers.vocab_parallel import VocabParallelEmbedding
from ferrox.model_spec import ModelSpec, UnsupportedModelError, sliding_layer_kinds
from ferrox.models.glm4 import (
    GLM_LORA_REFUSAL,
    check_checkpoint_quantization,
    interleaved_rotary_order,
    reorder_rotary_rows,
)
from ferrox.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP
from ferrox.models.smollm3 import NO_ROPE


class CohereLayerNorm(nn.Module):
    """Mean-centred LayerNorm with a weight and no bias, computed in float32 (transformers' CohereLayerNorm)."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype, device: torch.device | str | None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype, device=device), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = F.layer_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return (self.weight.float() * normed).to(x.dtype)


class Cohere2DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, backend: AttentionBackend, ops: DeviceOps, dtype: torch.dtype,
                 device: torch.device | str, window: int, eps: float):
        super().__init__()
        self.input_layernorm = CohereLayerNorm(spec.hidden_size, eps, dtype, device)
        self.self_attn = LlamaAttention(spec, backend, ops, dtype, device, qkv_bias=spec.attention_bias,
                                        o_bias=spec.attention_bias, qk_norm=False, window=window)
        self.mlp = LlamaMLP(spec, ops, dtype, device)

    def forward(self, x: torch.Tensor, rope: Any, kv_cache: torch.Tensor, meta: Any) -> torch.Tensor:
        n = self.input_layernorm(x)
        return x + self.self_attn(n, rope, kv_cache, meta) + self.mlp(n)


def layer_norm_eps(config: dict[str, Any]) -> float:
    eps = config.get("layer_norm_eps", 1e-5)
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not math.isfinite(eps) or eps <= 0:
        raise UnsupportedModelError(f"config.json: layer_norm_eps must be a positive number, got {eps!r}")
    return float(eps)


class Cohere2Model(nn.Module):
    qk_norm = False

    def __init__(self, spec: ModelSpec, backend: AttentionBackend, ops: DeviceOps, dtype: torch.dtype,
                 device: torch.device | str, **_: Any):
        super().__init__()
        eps = layer_norm_eps(spec.hf_config)
        self.embed_tokens = VocabParallelEmbedding(spec.vocab_size, spec.hidden_size, dtype=dtype, device=device)
        self.layers = nn.ModuleList(Cohere2DecoderLayer(spec, backend, ops, dtype, device, spec.window_of(i), eps)
                                    for i in range(spec.num_layers))
        self.norm = CohereLayerNorm(spec.hidden_size, eps, dtype, device)
        self.rotary = RotaryEmbedding.for_spec(spec, device, ops)
        # (the kinds from the config, not the served windows: a window no shorter than the context still rotates)
        self.rotary_layers = sliding_layer_kinds(spec.hf_config, spec.num_layers, "config.json")
        self.backend = backend
        self.one_token_layers = None  # (the parallel LayerNorm block is not the fused kernels' shape)
        self.decode_path = backend.decode_path(None, self.rotary.rope_rows)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                meta: Any, inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        h = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
        rope: Rope = self.rotary(positions, h.dtype)
        for i, layer in enumerate(self.layers):
            h = layer(h, rope if self.rotary_layers[i] else NO_ROPE, kv_caches[i], meta)
        return self.norm(h)


class Cohere2ForCausalLM(LlamaForCausalLM):
    model_class = Cohere2Model
    supports_quantized_gguf = False  # (no GGUF mapping: loader/gguf_file.py)

    def __init__(self, spec: ModelSpec, dtype: torch.dtype, device: torch.device | str, *,
                 kernels: str | None = None):
        config = spec.hf_config
        if not config.get("sliding_window"):
            raise UnsupportedModelError("config.json: sliding_window null is not supported for Cohere2ForCausalLM "
                                        "(transformers' Cohere2 layers then take no rotary anywhere)")
        if config.get("use_qk_norm"):
            raise UnsupportedModelError("config.json: use_qk_norm is not supported for Cohere2ForCausalLM")
        scale = config.get("logit_scale", 0.0625)
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
            raise UnsupportedModelError(f"config.json: logit_scale must be a number, got {scale!r}")
        order = interleaved_rotary_order(spec.head_dim, spec.head_dim)
        check_checkpoint_quantization(spec, order, block_fp8=False)
        super().__init__(spec, dtype, device, kernels=kernels)
        self.logit_scale = float(scale)
        self.lora_refusal = GLM_LORA_REFUSAL.format(arch=spec.architecture)
        self.rotary_order = order

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return super().compute_logits(hidden) * self.logit_scale

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        super().load_weights(reorder_rotary_rows(weights, self.spec.head_dim, self.rotary_order))


__all__ = ["Cohere2ForCausalLM"]
