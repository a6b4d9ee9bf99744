"""The token-mixing half of a hybrid decoder layer (models/qwen3_5.py, models/granitemoehybrid.py): the pre-norm,
then the layer's one mixer -- a recurrent one (Gated DeltaNet, Mamba2: states in pool rows, `step`) or attention
(a KV cache) -- then the post-attention norm that opens the MLP half. Each family names its recurrent mixer as its
checkpoint does (`linear_attn`, `mamba`) and runs its own MLP after this."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ferrox.attention.metadata import AttentionMetadata
from ferrox.layers.ops import Rope


class HybridMixingLayer(nn.Module):
    input_layernorm: Any
    post_attention_layernorm: Any
    self_attn: Any  # the attention mixer, None in a recurrent layer

    def recurrent_mixer(self) -> nn.Module | None:
        """The recurrent mixer (None in an attention layer), under the family's checkpoint name."""
        raise NotImplementedError

    def mix(self, x: torch.Tensor, residual: torch.Tensor | None, rope: Rope, kv_cache: torch.Tensor,
            meta: AttentionMetadata, step: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """(the MLP's input, the residual) after this layer's token mixer."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm(x, residual)
        recurrent = self.recurrent_mixer()
        if recurrent is not None:
            h = recurrent(h, meta, step)
        else:
            assert self.self_attn is not None
            h = self.self_attn(h, rope, kv_cache, meta)
        return self.post_attention_layernorm(h, residual)
