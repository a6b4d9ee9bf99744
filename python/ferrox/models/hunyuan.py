"""Hunyuan dense (tencent/Hunyuan-7B-Instruct, -4B, -1.8B, -0.5B: HunYuanDenseV1ForCausalLM) and MoE
(tencent/Hunyuan-A13B-Instruct: HunYuanMoEV1ForCausalLM), as transformers' HunYuanDenseV1 / HunYuanMoEV1 define them:
Llama's layers with two differences --

- q and k are RMS-normed per head AFTER rotary (`query_layernorm` / `key_layernorm`; Qwen3 norms before);
- the releases' rope scaling `{"type": "dynamic", "alpha": A}` is NTK-alpha: a fixed base of rope_theta *
  A ** (head_dim / (head_dim - 2)), whatever the sequence length (a dynamic scaling without `alpha`, which would
  depend on the length, is refused as for every family).

The MoE's every layer routes: softmax top-`moe_topk` over `num_experts` (router `mlp.gate.wg`, float32), the weights
renormalised, experts of `moe_intermediate_size` (else intermediate_size), plus an ungated shared MLP
(`mlp.shared_mlp`, `num_shared_expert` times that width). The release lists some of these per layer; equal entries
are taken, differing ones (and cross-layer KV sharing, `use_cla`) are refused by name.

Decoding takes the general path (the fused one-token kernels norm q/k before rotary). Tensor parallelism comes with
Llama's projections and the MoE stack (the per-head norms are replicated). Refused by name: GGUF files.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from ferrox.attention.backend import AttentionBackend
from ferrox.config_fields import to_int
from ferrox.layers.fused_moe import TopKRouter, experts_with_shared
from ferrox.layers.layernorm import RMSNorm
from ferrox.layers.ops import DeviceOps, Rope
from ferrox.model_spec import ModelLoadError, ModelSpec, MoeSpec, UnsupportedModelError, rope_type_of
from ferrox.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP, LlamaModel
from ferrox.models.moe import MoeBlock, MoeForCausalLM, MoeModel


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


# ---- MoE -----------------------------------------------------------------------------------------------
def _uniform(config: dict[str, Any], key: str, default: Any) -> Any:
    """config[key], or its one value where the release lists it per layer."""
    value = config.get(key, default)
    if isinstance(value, list):
        if not value or any(v != value[0] for v in value):
            raise UnsupportedModelError(f"config.json: {key} {value!r} differs between layers, which is not supported "
                                        "for HunYuanMoEV1ForCausalLM")
        value = value[0]
    return value


def hunyuan_moe_spec(spec: ModelSpec) -> ModelSpec:
    config = spec.hf_config
    if config.get("use_cla"):
        raise UnsupportedModelError("config.json: use_cla (KV shared across layers) is not supported for "
                                    "HunYuanMoEV1ForCausalLM")
    num_experts = to_int(_uniform(config, "num_experts", 1), "config.json: field 'num_experts'")
    top_k = to_int(_uniform(config, "moe_topk", 1), "config.json: field 'moe_topk'")
    if top_k > num_experts:
        raise ModelLoadError(f"config.json: moe_topk {top_k} is more than the {num_experts} num_experts")
    inter = to_int(_uniform(config, "moe_intermediate_size", spec.intermediate_size),
                   "config.json: field 'moe_intermediate_size'")
    moe = MoeSpec(num_experts=num_experts, num_experts_per_tok=top_k, intermediate_size=inter, norm_topk_prob=True)
    return dataclasses.replace(hunyuan_spec(spec), moe=moe)


class _Gate(nn.Module):
    """The checkpoint's `mlp.gate`: its float32 router under `wg`."""

    def __init__(self, hidden_size: int, num_experts: int, device: torch.device | str | None):
        super().__init__()
        self.wg = TopKRouter(hidden_size, num_experts, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.wg(x)


class HunyuanMoeBlock(MoeBlock):
    # (routing is MoeBlock's softmax top-k, but the layers' norms after rotary keep every one-token step on the
    # general path: the fused kernels would run them with Qwen3's order)
    fused_decode_routing = False

    def __init__(self, spec: ModelSpec, moe: MoeSpec, ops: DeviceOps, dtype, device, *, renormalize: bool):
        super().__init__(spec, moe, ops, dtype, device, renormalize=renormalize)
        self.gate = _Gate(spec.hidden_size, moe.num_experts, device)  # type: ignore[assignment]
        shared = to_int(_uniform(spec.hf_config, "num_shared_expert", 1), "config.json: field 'num_shared_expert'",
                        minimum=0)
        self.shared_mlp = (LlamaMLP(dataclasses.replace(spec, intermediate_size=moe.intermediate_size * shared), ops,
                                    dtype, device) if shared else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.route(x)
        if self.shared_mlp is None:
            return self.experts(x, weights, ids)
        return experts_with_shared(self.experts, x, weights, ids, self.shared_mlp, x)


class HunyuanMoeModel(MoeModel):
    block_class = HunyuanMoeBlock
    attention_class = HunyuanAttention


class HunYuanMoEV1ForCausalLM(MoeForCausalLM):
    model_class = HunyuanMoeModel

    def __init__(self, spec: ModelSpec, dtype: torch.dtype, device: torch.device | str, *,
                 kernels: str | None = None):
        super().__init__(hunyuan_moe_spec(spec), dtype, device, kernels=kernels)


__all__ = ["HunYuanDenseV1ForCausalLM", "HunYuanMoEV1ForCausalLM", "hunyuan_spec"]
