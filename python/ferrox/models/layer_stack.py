"""The decoder stack of families whose layers carry their own residual stream (GLM-4's sandwich norms, OLMo 2's
post-norms): token embeddings, the layers, the final norm, the rotary, and the general decode path (the fused
one-token kernels fuse Llama's pre-norm layer shape, which these are not). A family names its layer class."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ferrox.attention.backend import AttentionBackend
from ferrox.layers.layernorm import RMSNorm
from ferrox.layers.ops import DeviceOps
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
