"""The post-norm decoder layer of OLMo 2 / OLMo 3 and EXAONE 4, as transformers' Olmo2DecoderLayer defines it: no input
norm; each sublayer's output is RMS-normed before its residual add --

    h = h + post_attention_layernorm(self_attn(h))
    h = h + post_feedforward_layernorm(mlp(h))

The family passes its attention (the norms inside it differ: OLMo's over the whole q/k projections, EXAONE's per
head); the MLP is Llama's."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ferrox.layers.layernorm import RMSNorm
from ferrox.layers.ops import DeviceOps
from ferrox.model_spec import ModelSpec
from ferrox.models.llama import LlamaMLP


class PostNormDecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, self_attn: nn.Module, ops: DeviceOps, dtype: torch.dtype,
                 device: torch.device | str):
        super().__init__()
        self.self_attn = self_attn
        self.mlp = LlamaMLP(spec, ops, dtype, device)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype, device, ops)
        self.post_feedforward_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype, device, ops)

    def forward(self, x: torch.Tensor, rope: Any, kv_cache: torch.Tensor, meta: Any) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(x, rope, kv_cache, meta))
        return x + self.post_feedforward_layernorm(self.mlp(x))


__all__ = ["PostNormDecoderLayer"]
