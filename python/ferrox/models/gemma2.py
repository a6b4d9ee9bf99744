"""Gemma 2 (google/gemma-2-2b/9b/27b and their -it): a decoder close to Llama's, with five differences
that transformers' Gemma2 defines and that ferrox follows:

- RMSNorm scales by (1 + weight): the weights are stored as offsets from 1, folded to 1 + w at load
  (finalize_weights), so every norm is ferrox's RMSNorm;
- four norms a layer: input and post-attention around attention, pre- and post-feedforward around
  the MLP, each output normed before its residual add;
- the embedding is multiplied by sqrt(hidden_size) rounded to the model dtype (transformers' normalizer),
  after the lookup, so a tied LM head keeps the unscaled rows;
- the MLP gates with GELU (tanh approximation, `hidden_activation` gelu_pytorch_tanh);
- attention scores scaled by query_pre_attn_scalar ** -0.5 and capped, softcap * tanh(score / softcap)
  with attn_logit_softcapping (the backend's `softcap`: torch, and both Triton kernels; the CUDA decode
  kernel and cuDNN prefill have no cap and step aside), and the logits capped with
  final_logit_softcapping.

Gemma 2 alternates sliding-window (4,096) and global layers over an 8,192 context: each layer's window
(ModelSpec.window_of) goes to the attention backend with its call. Decoding takes the general path (no fused one-token kernels:
the four-norm layer is not the pre-norm shape they fuse); CUDA graphs, tensor parallelism, LoRA on
the Llama projection names and online FP8 come with the layers.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ferrox.attention.backend import AttentionBackend
from ferrox.layers.layernorm import RMSNorm
from ferrox.layers.linear import MergedLinear, RowParallelLinear
from ferrox.layers.ops import DeviceOps, Rope
from ferrox.layers.rotary import RotaryEmbedding
from ferrox.layers.vocab_parallel import VocabParallelEmbedding
from ferrox.model_spec import ModelSpec, UnsupportedModelError
from ferrox.models.llama import LlamaAttention, LlamaForCausalLM

# Gemma's activation names for GELU with the tanh approximation (transformers' ACT2FN keys).
_GELU_TANH = ("gelu_pytorch_tanh", "gelu_new", "gelu_fast")


def check_gelu_tanh(spec: ModelSpec) -> None:
    """Gemma's MLP runs tanh-approximated GELU: any other hidden_activation is refused by name."""
    config = spec.hf_config
    act = config.get("hidden_activation") or config.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in _GELU_TANH:
        raise UnsupportedModelError(f"config.json: hidden_activation {act!r} is not supported for "
                                    f"{spec.architecture} (only {', '.join(_GELU_TANH)})")


def embedding_normalizer(hidden_size: int, dtype: torch.dtype) -> float:
    """sqrt(hidden_size) as transformers multiplies the embeddings by it: a tensor of the model dtype
    (rounded there: 59.75 rather than 59.87 for Gemma 2 9B in bf16)."""
    return float(torch.tensor(math.sqrt(hidden_size), dtype=dtype))


class GemmaMLP(nn.Module):
    def __init__(self, spec: ModelSpec, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        inter = spec.intermediate_size
        self.gate_up_proj = MergedLinear(spec.hidden_size, {"gate": inter, "up": inter}, bias=False, dtype=dtype,
                                         device=device)
        self.down_proj = RowParallelLinear(inter, spec.hidden_size, bias=False, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class Gemma2DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, backend: AttentionBackend, ops: DeviceOps, dtype: torch.dtype,
                 device: torch.device | str, window: int = 0, qk_norm: bool = False):
        super().__init__()

        def norm() -> RMSNorm:
            return RMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype, device, ops)

        self.input_layernorm, self.post_attention_layernorm = norm(), norm()
        self.pre_feedforward_layernorm, self.post_feedforward_layernorm = norm(), norm()
        self.self_attn = LlamaAttention(spec, backend, ops, dtype, device, qkv_bias=spec.attention_bias,
                                        o_bias=spec.attention_bias, qk_norm=qk_norm, window=window)
        self.mlp = GemmaMLP(spec, dtype, device)

    def forward(self, x: torch.Tensor, rope: Rope, kv_cache: torch.Tensor, meta: Any) -> torch.Tensor:
        h = self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), rope, kv_cache, meta))
        x = x + h
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class Gemma2Model(nn.Module):
    # Per-head q/k norms (Gemma 3's; models/gemma3.py).
    gemma_qk_norm = False

    def __init__(self, spec: ModelSpec, backend: AttentionBackend, ops: DeviceOps, dtype: torch.dtype,
                 device: torch.device | str, **_: Any):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(spec.vocab_size, spec.hidden_size, dtype=dtype, device=device)
        self.normalizer = embedding_normalizer(spec.hidden_size, dtype)
        self.layers = nn.ModuleList(Gemma2DecoderLayer(spec, backend, ops, dtype, device, spec.window_of(i),
                                                       qk_norm=self.gemma_qk_norm) for i in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype, device, ops)
        self.rotary = self.make_rotary(spec, device, ops)
        self.backend = backend
        self.qk_norm = self.gemma_qk_norm
        self.one_token_layers = None  # (the four-norm layer is not the pre-norm shape they fuse)
        self.decode_path = backend.decode_path(None, self.rotary.rope_rows)

    def make_rotary(self, spec: ModelSpec, device: torch.device | str, ops: DeviceOps) -> RotaryEmbedding:
        return RotaryEmbedding.for_spec(spec, device, ops)

    def layer_ropes(self, positions: torch.Tensor, dtype: torch.dtype) -> list[Rope]:
        """Each layer's rotary for this step (one for every layer here)."""
        return [self.rotary(positions, dtype)] * len(self.layers)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids) * self.normalizer

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                meta: Any, inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        h = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
        for i, (layer, rope) in enumerate(zip(self.layers, self.layer_ropes(positions, h.dtype), strict=True)):
            h = layer(h, rope, kv_caches[i], meta)
        return self.norm(h)


class Gemma2ForCausalLM(LlamaForCausalLM):
    model_class = Gemma2Model
    # llama.cpp's gemma2 / gemma3 files (loader/gguf_file.py) stay quantized on the CPU: the general path
    # over the Rust kernels' quantized matmuls (the fused Rust decoder fits the Llama layer only).
    supports_quantized_gguf = True

    def __init__(self, spec: ModelSpec, dtype: torch.dtype, device: torch.device | str, *,
                 kernels: str | None = None):
        config = spec.hf_config
        check_gelu_tanh(spec)
        scalar = config.get("query_pre_attn_scalar") or spec.head_dim
        super().__init__(dataclasses.replace(spec, attention_scale=float(scalar) ** -0.5), dtype, device,
                         kernels=kernels)
        self.backend.softcap = float(config.get("attn_logit_softcapping") or 0.0)
        self.final_softcap = float(config.get("final_logit_softcapping") or 0.0)
        self._norms_folded = False

    def finalize_weights(self) -> None:
        """Gemma's norms scale by 1 + weight: fold the 1 in once, so they run as plain RMSNorms."""
        if not self._norms_folded:
            for module in self.modules():
                if isinstance(module, RMSNorm):
                    module.weight.data += 1.0
            self._norms_folded = True
        super().finalize_weights()

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        if self.final_softcap:
            logits = self.final_softcap * torch.tanh(logits / self.final_softcap)
        return logits
