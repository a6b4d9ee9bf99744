"""Cohere Command R / R+ and Aya (CohereLabs/c4ai-command-r-v01, c4ai-command-r-plus, aya-expanse-8b/32b, aya-23:
CohereForCausalLM), as transformers' Cohere defines it; Command R7B / Command A (models/cohere2.py) build on it.

- a parallel block: h = h + attn(n) + mlp(n) with n = input_layernorm(h), one norm a layer;
- Cohere's LayerNorm: mean-centred, scaled by a weight, no bias, in float32 (`layer_norm_eps`), also the final norm;
- rotary in the INTERLEAVED layout (dims 2i, 2i + 1 pair): each head's q and k rows are reordered while loading into
  ferrox's half-split pairs (models/glm4.py), as are the per-head q/k norm weights;
- `use_qk_norm` (Command R+): q and k LayerNormed per head before rotary, each head with its own [head_dim] weight;
- logits times `logit_scale` (0.0625 / 0.125 in the releases); tied embeddings in the releases.

Decoding takes the general path (the fused one-token kernels run pre-norm RMSNorm layers). Tensor parallelism comes
with Llama's projections; with `use_qk_norm` each rank holds its heads' norm weights (Command R+, 104B, needs it). A
checkpoint quantization_config: refused by name. LoRA adapters' q/k rows are permuted as the weights' (models/glm4.py
InterleavedRotaryRows.lora_rewrite). GGUF files (llama.cpp's "command-r", "cohere2") load dequantized:
loader/gguf_families.py.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ferrox.attention.backend import AttentionBackend
from ferrox.distributed.parallel_state import get_tp_group
from ferrox.distributed.sharding import even_split, kv_head_range, materialize
from ferrox.layers.ops import DeviceOps, Rope
from ferrox.layers.rotary import RotaryEmbedding
from ferrox.model_spec import ModelSpec, UnsupportedModelError
from ferrox.models.glm4 import InterleavedRotaryRows, interleaved_rotary_setup
from ferrox.models.layer_stack import PerLayerRopeStack
from ferrox.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP


class CohereLayerNorm(nn.Module):
    """Mean-centred LayerNorm over the last dim with a weight and no bias, in float32 (transformers' CohereLayerNorm);
    `shape` [heads, head_dim] for the per-head q/k norms (weights per head, stored flat). Under tensor parallelism a
    per-head norm holds its rank's heads: `first_head`, the first of them in the checkpoint's [all heads, head_dim]."""

    def __init__(self, shape: tuple[int, ...], eps: float, dtype: torch.dtype, device: torch.device | str | None,
                 first_head: int = 0):
        super().__init__()
        self.eps = eps
        self.shape = shape
        self.first_head = first_head
        self.weight = nn.Parameter(torch.ones(math.prod(shape), dtype=dtype, device=device), requires_grad=False)

    def load_weight(self, param_name: str, tensor: Any, shard: str | None = None) -> None:
        """The checkpoint's weight in its own shape ([hidden] or [heads, head_dim]), flat here; a per-head norm's
        checkpoint holds every head, of which this rank takes its own."""
        value = materialize(tensor).reshape(-1)
        if len(self.shape) == 2 and value.numel() != self.weight.numel() and value.numel() % self.shape[1] == 0:
            heads = value.numel() // self.shape[1]
            if self.first_head + self.shape[0] <= heads:
                value = value.view(heads, self.shape[1])[self.first_head:self.first_head + self.shape[0]].reshape(-1)
        if value.numel() != self.weight.numel():
            raise ValueError(f"checkpoint shape {tuple(materialize(tensor).shape)}, model expects {self.shape} "
                             f"(heads from {self.first_head})")
        self.weight.data.copy_(value)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = F.layer_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return (self.weight.float().view(self.shape) * normed).to(x.dtype)


class CohereAttention(LlamaAttention):
    """Llama's attention with Cohere's optional per-head q/k LayerNorms before rotary."""

    def __init__(self, spec: ModelSpec, backend: AttentionBackend, ops: DeviceOps, dtype: torch.dtype,
                 device: torch.device | str, *, window: int, eps: float, qk_norm: bool):
        super().__init__(spec, backend, ops, dtype, device, qkv_bias=spec.attention_bias, o_bias=spec.attention_bias,
                         qk_norm=False, window=window)
        self.cohere_qk_norm = qk_norm
        if qk_norm:
            # (this rank's heads under tensor parallelism, as qkv_proj holds them: layers/linear.py QKVLinear)
            tp = get_tp_group()
            q_start = even_split(spec.num_heads, tp.size, tp.rank, "num_attention_heads")[0]
            kv_start = kv_head_range(spec.num_kv_heads, tp.size, tp.rank)[0]
            self.q_norm = CohereLayerNorm((self.num_heads, self.head_dim), eps, dtype, device,  # type: ignore[assignment]
                                          first_head=q_start)
            self.k_norm = CohereLayerNorm((self.num_kv_heads, self.head_dim), eps, dtype, device,  # type: ignore[assignment]
                                          first_head=kv_start)

    def forward(self, x, rope: Rope, kv_cache, meta):
        if not self.cohere_qk_norm:
            return super().forward(x, rope, kv_cache, meta)
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q_norm, k_norm = self.q_norm, self.k_norm
        assert q_norm is not None and k_norm is not None
        q = q_norm(qkv[:, :q_size].reshape(t, self.num_heads, self.head_dim))
        k = k_norm(qkv[:, q_size:q_size + kv_size].reshape(t, self.num_kv_heads, self.head_dim))
        q, k = rope.rotate(q, k)
        o = self.backend.forward(q, k, qkv[:, q_size + kv_size:].view(t, self.num_kv_heads, self.head_dim), kv_cache,
                                 meta, self.scale, self.kv_scales, window=self.window)
        return self.o_proj(o.reshape(t, q_size))


class CohereDecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, backend: AttentionBackend, ops: DeviceOps, dtype: torch.dtype,
                 device: torch.device | str, *, window: int, eps: float, qk_norm: bool):
        super().__init__()
        self.input_layernorm = CohereLayerNorm((spec.hidden_size,), eps, dtype, device)
        self.self_attn = CohereAttention(spec, backend, ops, dtype, device, window=window, eps=eps, qk_norm=qk_norm)
        self.mlp = LlamaMLP(spec, ops, dtype, device)

    def forward(self, x: torch.Tensor, rope: Any, kv_cache: torch.Tensor, meta: Any) -> torch.Tensor:
        n = self.input_layernorm(x)
        return x + self.self_attn(n, rope, kv_cache, meta) + self.mlp(n)


def layer_norm_eps(config: dict[str, Any]) -> float:
    eps = config.get("layer_norm_eps", 1e-5)
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not math.isfinite(eps) or eps <= 0:
        raise UnsupportedModelError(f"config.json: layer_norm_eps must be a positive number, got {eps!r}")
    return float(eps)


class CohereModel(PerLayerRopeStack):
    def __init__(self, spec: ModelSpec, backend: AttentionBackend, ops: DeviceOps, dtype: torch.dtype,
                 device: torch.device | str, **_: Any):
        eps = layer_norm_eps(spec.hf_config)
        qk_norm = bool(spec.hf_config.get("use_qk_norm", False))
        layers: list[nn.Module] = [CohereDecoderLayer(spec, backend, ops, dtype, device, window=spec.window_of(i),
                                                      eps=eps, qk_norm=qk_norm) for i in range(spec.num_layers)]
        super().__init__(spec, backend, dtype, device, layers, CohereLayerNorm((spec.hidden_size,), eps, dtype, device),
                         RotaryEmbedding.for_spec(spec, device, ops), self.layer_rotaries(spec))

    def layer_rotaries(self, spec: ModelSpec) -> tuple[bool, ...]:
        """Which layers rotate q and k (every one here; Cohere2: its sliding ones)."""
        return (True,) * spec.num_layers


def _flat_qk_norms(weights: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
    """Per-head q/k norm weights [heads, head_dim] flattened, so the rotary reordering takes their head rows."""
    for name, tensor in weights:
        if name.endswith(("self_attn.q_norm.weight", "self_attn.k_norm.weight")):
            tensor = materialize(tensor).reshape(-1)
        yield name, tensor


class CohereForCausalLM(InterleavedRotaryRows, LlamaForCausalLM):
    model_class: type[CohereModel] = CohereModel
    supports_quantized_gguf = False  # (a GGUF file loads dequantized: loader/gguf_families.py)

    def __init__(self, spec: ModelSpec, dtype: torch.dtype, device: torch.device | str, *,
                 kernels: str | None = None):
        config = spec.hf_config
        scale = config.get("logit_scale", 0.0625)
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
            raise UnsupportedModelError(f"config.json: logit_scale must be a number, got {scale!r}")
        order = interleaved_rotary_setup(spec)
        super().__init__(spec, dtype, device, kernels=kernels)
        self.logit_scale = float(scale)
        self.rotary_order: torch.Tensor | None = order

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return super().compute_logits(hidden) * self.logit_scale

    def rotary_stream(self, weights: Iterable[tuple[str, Any]]) -> Iterable[tuple[str, Any]]:
        return _flat_qk_norms(weights)


__all__ = ["CohereForCausalLM", "CohereLayerNorm", "CohereModel"]
