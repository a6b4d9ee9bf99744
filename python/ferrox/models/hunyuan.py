"""Hunyuan dense (tencent/Hunyuan-7B-Instruct, -4B, -1.8B, -0.5B: HunYuanDenseV1ForCausalLM), as transformers'
HunYuanDenseV1 defines it: Llama's layers with two differences --

- q and k are RMS-normed per head AFTER rotary (`query_layernorm` / `key_layernorm`; Qwen3 norms before);
- the releases' rope scaling `{"type": "dynamic", "alpha": A}` is NTK-alpha: a fixed base of rope_theta *
  A ** (head_dim / (head_dim - 2)), whatever the sequence length (a dynamic scaling without `alpha`, which would
  depend on the length, is refused as for every family).

Decoding takes the general path (the fused one-token kernels norm q/k before rotary). Tensor parallelism comes with
Llama's projections (the per-head norms are replicated). Refused by name: GGUF files.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ferrox.attention.backend import AttentionBackend
from ferrox.layers.layernorm import RMSNorm
from ferrox.layers.ops import DeviceOps, Rope
from ferrox.model_spec import ModelSpec, UnsupportedModelError, rope_type_of
from ferrox.models.llama import LlamaAttention, LlamaForCausalLM, LlamaModel


def hunyuan_spec(spec: ModelSpec) -> ModelSpec:
    """The spec with NTK-alpha folded into the rotary base (module docstring)."""
    scaling = spec.rope_scaling
    if scaling is None or rope_type_of(scaling) != "dynamic" or scaling.get("alpha") is None:
        return spec
    alpha = scaling["alpha"]
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or alpha <= 0:
        raise UnsupportedModelError(f"config.json: rope_scaling.alpha must be a positive number, got {alpha!r}")
    d = spec.head_dim
    return dataclasses.replace(spec, rope_theta=spec.rope_theta * float(alpha) ** (d / (d - 2)), rope_scaling=None)


class HunyuanAttention(LlamaAttention):
    """Llama's attention, q and k RMS-normed per head after rotary."""

    def __init__(self, spec: ModelSpec, backend: AttentionBackend, ops: DeviceOps, dtype: torch.dtype,
                 device: torch.device | str, **kwargs: Any):
        super().__init__(spec, backend, ops, dtype, device, **{**kwargs, "qk_norm": False})
        self.query_layernorm = RMSNorm(self.head_dim, spec.rms_norm_eps, dtype, device, ops)
        self.key_layernorm = RMSNorm(self.head_dim, spec.rms_norm_eps, dtype, device, ops)

    def forward(self, x, rope: Rope, kv_cache, meta):
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k = rope.rotate_qk(qkv[:, :q_size + kv_size].view(t, self.num_heads + self.num_kv_heads, self.head_dim),
                              self.num_heads)
        q = self.query_layernorm(q.reshape(-1, self.head_dim)).view(t, self.num_heads, self.head_dim)
        k = self.key_layernorm(k.reshape(-1, self.head_dim)).view(t, self.num_kv_heads, self.head_dim)
        v = qkv[:, q_size + kv_size:].view(t, self.num_kv_heads, self.head_dim)
        o = self.backend.forward(q, k, v, kv_cache, meta, self.scale, self.kv_scales, window=self.window)
        return self.o_proj(o.reshape(t, q_size))


class HunyuanModel(LlamaModel):
    attention_class = HunyuanAttention
    # (norms after rotary: not what the fused one-token kernels run; the path may still fuse the lm_head)
    fused_one_token = False


class HunYuanDenseV1ForCausalLM(LlamaForCausalLM):
    model_class = HunyuanModel
    supports_quantized_gguf = False  # (no GGUF mapping: loader/gguf_file.py)

    def __init__(self, spec: ModelSpec, dtype: torch.dtype, device: torch.device | str, *,
                 kernels: str | None = None):
        super().__init__(hunyuan_spec(spec), dtype, device, kernels=kernels)


__all__ = ["HunYuanDenseV1ForCausalLM", "hunyuan_spec"]
