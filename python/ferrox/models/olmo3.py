"""OLMo 3 (allenai/Olmo-3-*: Olmo3ForCausalLM): OLMo 2's layers (models/olmo2.py: post-norms, RMSNorm over the
whole q and k projections) with sliding-window attention on three of every four layers, as transformers' Olmo3
defines it:

- layer_types names each layer's kind (transformers' default when absent: every fourth layer full attention, the
  rest sliding_attention) and sliding_window its window (4,096 in the releases);
- the two kinds rotate differently: both from rope_theta (500,000), the rope scaling only on the full-attention
  layers (the long-context releases' YaRN) -- config.json's rope_scaling, or transformers >= 5's rope_parameters
  keyed by layer type.

A window at least as long as the served context changes nothing (the layer attends fully: ModelSpec.window_of),
but its layer keeps the sliding kind's rotary. Refused as for OLMo 2: tensor parallelism, `clip_qkv`, `mlp_bias`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ferrox.attention.backend import AttentionBackend
from ferrox.layers.layernorm import RMSNorm
from ferrox.layers.ops import DeviceOps
from ferrox.layers.rotary import RotaryEmbedding
from ferrox.layers.vocab_parallel import VocabParallelEmbedding
from ferrox.model_spec import ModelSpec, sliding_layer_kinds
from ferrox.models.llama import LlamaForCausalLM, LlamaMLP
from ferrox.models.olmo2 import FullQKNormAttention, check_olmo_config

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


class Olmo3DecoderLayer(nn.Module):
    """OLMo 2's post-norm layer with this layer's window."""

    def __init__(self, spec: ModelSpec, backend: AttentionBackend, ops: DeviceOps, dtype: torch.dtype,
                 device: torch.device | str, window: int):
        super().__init__()
        self.self_attn = FullQKNormAttention(spec, backend, ops, dtype, device,
                                             q_norm_size=spec.num_heads * spec.head_dim, clip_qkv=None, window=window)
        self.mlp = LlamaMLP(spec, ops, dtype, device)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype, device, ops)
        self.post_feedforward_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype, device, ops)

    def forward(self, x: torch.Tensor, rope: Any, kv_cache: torch.Tensor, meta: Any) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(x, rope, kv_cache, meta))
        return x + self.post_feedforward_layernorm(self.mlp(x))


class Olmo3Model(nn.Module):
    qk_norm = False  # (LlamaForCausalLM reads it with one-token layers; these layers have none)

    def __init__(self, spec: ModelSpec, backend: AttentionBackend, ops: DeviceOps, dtype: torch.dtype,
                 device: torch.device | str, **_: Any):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(spec.vocab_size, spec.hidden_size, dtype=dtype, device=device)
        self.layers = nn.ModuleList(Olmo3DecoderLayer(spec, backend, ops, dtype, device, spec.window_of(i))
                                    for i in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype, device, ops)
        (sliding_theta, sliding_scaling), (full_theta, full_scaling) = rope_settings(spec.hf_config)
        # The full-attention layers' rotary is the model's `rotary` (the decode path's position rows come from it).
        self.rotary = RotaryEmbedding(spec.head_dim, full_theta, full_scaling, device, ops,
                                      max_position_embeddings=spec.max_position_embeddings)
        self.rotary_sliding = RotaryEmbedding(spec.head_dim, sliding_theta, sliding_scaling, device, ops,
                                              max_position_embeddings=spec.max_position_embeddings)
        # (the kinds, not spec.sliding_layers: a window no shorter than the context leaves that unset, and the
        # sliding layers still rotate their own way)
        self.sliding = sliding_layer_kinds(spec.hf_config, spec.num_layers, "config.json")
        self.backend = backend
        self.one_token_layers = None  # (post-norm layers, full-width q/k norms: not what the fused kernels run)
        self.decode_path = backend.decode_path(None, self.rotary.rope_rows)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                meta: Any, inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        h = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
        rope_full = self.rotary(positions, h.dtype)
        rope_sliding = self.rotary_sliding(positions, h.dtype) if any(self.sliding) else rope_full
        for i, layer in enumerate(self.layers):
            h = layer(h, rope_sliding if self.sliding[i] else rope_full, kv_caches[i], meta)
        return self.norm(h)


class Olmo3ForCausalLM(LlamaForCausalLM):
    model_class = Olmo3Model
    supports_tensor_parallel = False  # the full-width q/k norms' variance would span ranks
    supports_quantized_gguf = False  # (no GGUF mapping: loader/gguf_file.py)

    def __init__(self, spec: ModelSpec, dtype: torch.dtype, device: torch.device | str, *,
                 kernels: str | None = None):
        check_olmo_config(spec, takes_clip_qkv=False, windowed=True)
        super().__init__(spec, dtype, device, kernels=kernels)


__all__ = ["Olmo3ForCausalLM"]
