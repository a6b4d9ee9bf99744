"""The decoder stacks of families whose layers carry their own residual stream (GLM-4's sandwich norms, OLMo 2's
post-norms, Cohere's parallel blocks): token embeddings, the layers, the final norm, the rotary, and the general
decode path (the fused one-token kernels fuse Llama's pre-norm layer shape, which these are not).

- ResidualLayerStack: a family names its layer class; one rotary for every layer.
- PerLayerRopeStack: the family builds its layers and says which rope each takes per step (`layer_ropes`): NoPE
  layers (EXAONE 4's and Cohere's global ones: `rotary_layers`), or two rotaries by layer kind (OLMo 3)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ferrox.attention.backend import AttentionBackend
from ferrox.layers.layernorm import RMSNorm
from ferrox.layers.ops import NO_ROPE, DeviceOps, Rope
from ferrox.layers.rotary import RotaryEmbedding
from ferrox.layers.vocab_parallel import VocabParallelEmbedding
from ferrox.model_spec import ModelSpec


class ResidualLayerStack(nn.Module):
    """layer_class(spec, backend, ops, dtype, device) layers, each `h = layer(h, rope, kv_cache, meta)`."""

    layer_class: type[nn.Module]
    qk_norm = False  # (LlamaForCausalLM reads it with one-token layers; these stacks have none)

    def __init__(self, spec: ModelSpec, backend: AttentionBackend, ops: DeviceOps, dtype: torch.dtype,
                 device: torch.device | str, **_: Any):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(spec.vocab_size, spec.hidden_size, dtype=dtype, device=device)
        self.layers = nn.ModuleList(self.layer_class(spec, backend, ops, dtype, device)
                                    for _ in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype, device, ops)
        self.rotary = RotaryEmbedding.for_spec(spec, device, ops)
        self.backend = backend
        self.one_token_layers = None
        self.decode_path = backend.decode_path(None, self.rotary.rope_rows)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                meta: Any, inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        h = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
        rope = self.rotary(positions, h.dtype)
        for i, layer in enumerate(self.layers):
            h = layer(h, rope, kv_caches[i], meta)
        return self.norm(h)


class PerLayerRopeStack(nn.Module):
    """Layers h = layer(h, rope_i, kv_cache, meta) with the rope `layer_ropes` gives each, then the final norm. By
    default layer i rotates with `rotary` where rotary_layers[i] and takes no rotary (NoPE) elsewhere."""

    qk_norm = False  # (LlamaForCausalLM reads it with one-token layers; these stacks have none)

    def __init__(self, spec: ModelSpec, backend: AttentionBackend, dtype: torch.dtype, device: torch.device | str,
                 layers: list[nn.Module], norm: nn.Module, rotary: RotaryEmbedding,
                 rotary_layers: tuple[bool, ...] | None = None):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(spec.vocab_size, spec.hidden_size, dtype=dtype, device=device)
        self.layers = nn.ModuleList(layers)
        self.norm = norm
        self.rotary = rotary
        self.rotary_layers = rotary_layers if rotary_layers is not None else (True,) * len(layers)
        self.backend = backend
        self.one_token_layers = None
        self.decode_path = backend.decode_path(None, rotary.rope_rows)

    def layer_ropes(self, positions: torch.Tensor, dtype: torch.dtype) -> list[Rope]:
        rope = self.rotary(positions, dtype)
        return [rope if rotates else NO_ROPE for rotates in self.rotary_layers]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                meta: Any, inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        h = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
        for layer, rope, kv_cache in zip(self.layers, self.layer_ropes(positions, h.dtype), kv_caches, strict=True):
            h = layer(h, rope, kv_cache, meta)
        return self.norm(h)
