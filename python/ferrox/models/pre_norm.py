"""The pre-norm decoder block of the Llama-shaped families (Llama, Qwen, Mistral, the MoE families,
DeepSeek, gpt-oss): attention over norm(x) added to x, then the MLP over norm of that sum added to it.
Each residual add rides the next norm: RMSNorm(h, residual) returns the normed sum and the sum (one
fused kernel on the GPU), so a layer hands its output and the running residual to the next, and the
final norm folds in the last add. A family's layer sets the four submodules and inherits `forward`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import torch
from torch import nn

from ferrox.layers.layernorm import RMSNorm
from ferrox.layers.ops import Rope


class PreNormDecoderLayer(nn.Module):
    """Subclasses set input_layernorm and post_attention_layernorm (RMSNorm), self_attn ((h, rope, kv_cache,
    meta) -> attention output) and mlp (h -> h); their own types stay visible to the type checker."""

    input_layernorm: RMSNorm
    post_attention_layernorm: RMSNorm

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, rope: Rope, kv_cache: torch.Tensor,
                meta: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's output, the residual stream before it is added): the first layer's residual is its input."""
        if residual is None:
            residual = x
            h = self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm(x, residual)
        h = cast(nn.Module, self.self_attn)(h, rope, kv_cache, meta)
        h, residual = self.post_attention_layernorm(h, residual)
        return cast(nn.Module, self.mlp)(h), residual


def run_pre_norm_layers(layers: Sequence[nn.Module], norm: RMSNorm, h: torch.Tensor, rope: Rope,
                        kv_caches: Sequence[torch.Tensor], meta: Any) -> torch.Tensor:
    """The layers in order, then the final norm over the last output plus the residual stream."""
    residual = None
    for i, layer in enumerate(layers):
        h, residual = layer(h, residual, rope, kv_caches[i], meta)
    h, _ = norm(h, residual)
    return h
