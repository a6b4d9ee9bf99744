"""OLMo 3 (allenai/Olmo-3-*: Olmo3ForCausalLM): OLMo 2's layers (models/olmo2.py: post-norms, RMSNorm over the
whole q and k projections) with sliding-window attention on three of every four layers, as transformers' Olmo3
defines it:

- layer_types names each layer's kind (transformers' default when absent: every fourth layer full attention, the
  rest sliding_attention) and sliding_window its window (4,096 in the releases);
- the two kinds rotate differently: both from rope_theta (500,000), the rope scaling only on the full-attention
  layers (the long-context releases' YaRN) -- config.json's rope_scaling, or transformers >= 5's rope_parameters
  keyed by layer type.

A window at least as long as the served context changes nothing (the layer attends fully: ModelSpec.window_of),
but its layer keeps the sliding kind's rotary. Tensor parallelism as for OLMo 2 (the norms' variance all-reduced); refused as for OLMo 2: `clip_qkv`, `mlp_bias`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ferrox.attention.backend import AttentionBackend
from ferrox.layers.layernorm import RMSNorm
from ferrox.layers.ops import DeviceOps, Rope
from ferrox.layers.rotary import RotaryEmbedding
from ferrox.model_spec import ModelSpec, sliding_layer_kinds
from ferrox.models.layer_stack import PerLayerRopeStack
from ferrox.models.llama import LlamaForCausalLM
from ferrox.models.olmo2 import FullQKNormAttention, check_olmo_config
from ferrox.models.post_norm import PostNormDecoderLayer

DEFAULT_THETA = 500_000.0


def rope_settings(config: dict[str, Any]) -> tuple[tuple[float, dict | None], tuple[float, dict | None]]:
    """((sliding theta, scaling), (full theta, scaling)) from either config format (module docstring)."""
    nested = config.get("rope_parameters")
    top_theta = config.get("rope_theta")
    if isinstance(nested, dict) and ("sliding_attention" in nested or "full_attention" in nested):
        def part(key: str) -> tuple[float, dict | None]:
            params = dict(nested.get(key) or {})
            theta = float(params.pop("rope_theta", top_theta if top_theta is not None else DEFAULT_THETA))
            kind = params.get("rope_type", params.get("type", "default"))
            return theta, (params if kind != "default" else None)

        return part("sliding_attention"), part("full_attention")
    flat = dict(nested) if isinstance(nested, dict) else {}
    theta = float(top_theta if top_theta is not None else flat.pop("rope_theta", DEFAULT_THETA))
    flat.pop("rope_theta", None)
    scaling = config.get("rope_scaling") or (flat or None)
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    return (theta, None), (theta, scaling if kind != "default" else None)


class Olmo3Model(PerLayerRopeStack):
    """OLMo 2's post-norm layers, windowed where served so; the sliding kinds' rotary beside the full layers'."""

    def __init__(self, spec: ModelSpec, backend: AttentionBackend, ops: DeviceOps, dtype: torch.dtype,
                 device: torch.device | str, **_: Any):
        layers: list[nn.Module] = [
            PostNormDecoderLayer(spec, FullQKNormAttention(spec, backend, ops, dtype, device,
                                                           q_norm_size=spec.num_heads * spec.head_dim, clip_qkv=None,
                                                           window=spec.window_of(i)), ops, dtype, device)
            for i in range(spec.num_layers)]
        (sliding_theta, sliding_scaling), (full_theta, full_scaling) = rope_settings(spec.hf_config)
        # The full-attention layers' rotary is the model's `rotary` (the decode path's position rows come from it).
        super().__init__(spec, backend, dtype, device, layers, RMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype,
                                                                      device, ops),
                         RotaryEmbedding(spec.head_dim, full_theta, full_scaling, device, ops,
                                         max_position_embeddings=spec.max_position_embeddings))
        self.rotary_sliding = RotaryEmbedding(spec.head_dim, sliding_theta, sliding_scaling, device, ops,
                                              max_position_embeddings=spec.max_position_embeddings)
        # (the kinds, not spec.sliding_layers: a window no shorter than the context leaves that unset, and the
        # sliding layers still rotate their own way)
        self.sliding = sliding_layer_kinds(spec.hf_config, spec.num_layers, "config.json")

    def layer_ropes(self, positions: torch.Tensor, dtype: torch.dtype) -> list[Rope]:
        rope_full = self.rotary(positions, dtype)
        rope_sliding = self.rotary_sliding(positions, dtype) if any(self.sliding) else rope_full
        return [rope_sliding if sliding else rope_full for sliding in self.sliding]


class Olmo3ForCausalLM(LlamaForCausalLM):
    model_class = Olmo3Model
    supports_tensor_parallel = True  # (the full-width q/k norms' variance all-reduced: models/olmo2.py)
    supports_quantized_gguf = False  # (no GGUF mapping: loader/gguf_families.py refuses OLMo 3 files by name)

    def __init__(self, spec: ModelSpec, dtype: torch.dtype, device: torch.device | str, *,
                 kernels: str | None = None):
        check_olmo_config(spec, takes_clip_qkv=False, windowed=True)
        super().__init__(spec, dtype, device, kernels=kernels)


__all__ = ["Olmo3ForCausalLM"]
