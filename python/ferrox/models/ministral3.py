"""Ministral 3 (Mistral AI, Dec 2025: Ministral-3-3B/8B/14B Base, Instruct and Reasoning; Devstral 2; the text
model of Mistral-Medium-3.5), as transformers' `ministral3` defines it: the Mistral decoder with two changes,
both read from config.json's `rope_parameters` (transformers' Ministral3Config names):

- YaRN rope (`rope_type` "yarn": factor, original_max_position_embeddings, beta_fast / beta_slow, mscale /
  mscale_all_dim), which layers/rotary.py computes as transformers does (cos and sin scaled by
  mscale(factor, mscale) / mscale(factor, mscale_all_dim) when both are set, else 0.1 ln(factor) + 1).
- Llama 4's query scaling (`llama_4_scaling_beta`): after rotary, each token's queries are multiplied by
  1 + beta * ln(1 + floor(p / original_max_position_embeddings)), p its position; keys and values are not.
  Beta 0 (params.json without llama_4_scaling) or absent: no scaling.

Everything else is Mistral's (head_dim from the config, sliding_window when set, a tied LM head in the 3B).
The scaling rides the step's Rope (`QueryScaledRope`: the queries a layer's rotary returns come back scaled),
so every Llama layer path applies it unchanged: eager, tensor-parallel (each rank scales its own heads),
piecewise CUDA graphs (computed from the positions inside the captured pieces). The fused one-token path
(attention/fused_decode.py) takes the same factor from `query_scale` and scales the queries its qkv kernel
returns before attending. The CPU Rust decoder of quantized GGUF files rotates without it, so GGUF blocks are
not kept packed (supports_quantized_gguf False; no GGUF architecture maps here anyway).

Mistral3ForConditionalGeneration with text_config.model_type "ministral3" (the hub's releases) builds the
same stack under its Pixtral tower (models/mistral3.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ferrox.attention.backend import AttentionBackend
from ferrox.layers.ops import DeviceOps, Rope
from ferrox.model_spec import ModelLoadError, ModelSpec
from ferrox.models.llama import LlamaModel, MistralForCausalLM
from ferrox.models.pre_norm import run_pre_norm_layers


@dataclass(frozen=True, slots=True)
class Llama4QueryScaling:
    """q *= 1 + beta * ln(1 + floor(p / original)) for the token at position p."""

    beta: float
    original: int  # rope_parameters.original_max_position_embeddings

    def __call__(self, positions: torch.Tensor) -> torch.Tensor:
        """float32 [T] factors of positions [T] (an integer floor, exact at any position)."""
        steps = torch.div(positions, self.original, rounding_mode="floor").to(torch.float32)
        return 1.0 + self.beta * torch.log(1.0 + steps)


def llama4_query_scaling(config: dict[str, Any]) -> Llama4QueryScaling | None:
    """The config's query scaling (rope_parameters.llama_4_scaling_beta and original_max_position_embeddings),
    None when it scales nothing (beta absent or 0)."""
    rope = next((v for v in (config.get("rope_parameters"), config.get("rope_scaling")) if isinstance(v, dict)), {})
    beta = rope.get("llama_4_scaling_beta")
    if beta is None:
        return None
    if isinstance(beta, bool) or not isinstance(beta, (int, float)):
        raise ModelLoadError(f"config.json: rope_parameters.llama_4_scaling_beta must be a number, got {beta!r}")
    if beta == 0:
        return None
    original = rope.get("original_max_position_embeddings")
    if isinstance(original, bool) or not isinstance(original, int) or original < 1:
        raise ModelLoadError("config.json: rope_parameters.llama_4_scaling_beta needs a positive integer "
                             f"rope_parameters.original_max_position_embeddings, got {original!r}")
    return Llama4QueryScaling(float(beta), original)


@dataclass(frozen=True, slots=True)
class QueryScaledRope:
    """The step's Rope with the rotated queries multiplied by a per-token factor (the product in float32, cast
    back to q's dtype, as vLLM computes it); keys as the inner Rope returns them."""

    rope: Rope
    q_scale: torch.Tensor  # float32 [T]

    def _scaled(self, q: torch.Tensor) -> torch.Tensor:
        return (q * self.q_scale[:, None, None]).to(q.dtype)

    def rotate_qk(self, qk: torch.Tensor, num_q_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
        q, k = self.rope.rotate_qk(qk, num_q_heads)
        return self._scaled(q), k

    def rotate(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q, k = self.rope.rotate(q, k)
        return self._scaled(q), k

    def norm_rotate_qk(self, qkv: torch.Tensor, num_q_heads: int, num_kv_heads: int, q_norm_weight: torch.Tensor,
                       k_norm_weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        q, k = self.rope.norm_rotate_qk(qkv, num_q_heads, num_kv_heads, q_norm_weight, k_norm_weight, eps)
        return self._scaled(q), k


class Ministral3Model(LlamaModel):
    """The Llama stack with Llama 4's query scaling (module docstring)."""

    def __init__(self, spec: ModelSpec, backend: AttentionBackend, ops: DeviceOps, dtype: torch.dtype,
                 device: torch.device | str, **kwargs: Any):
        super().__init__(spec, backend, ops, dtype, device, **kwargs)
        self.query_scale = llama4_query_scaling(spec.hf_config)
        if self.query_scale is not None:
            self.decode_path = backend.decode_path(self.one_token_layers, self.rotary.rope_rows,
                                                   q_scale=self.query_scale)

    def forward(self, input_ids, positions, kv_caches, meta, inputs_embeds=None):
        if self.query_scale is None:
            return super().forward(input_ids, positions, kv_caches, meta, inputs_embeds=inputs_embeds)
        h = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        if self.decode_path.takes_step(h.shape[0], kv_caches, meta):
            return self.norm(self.decode_path.forward(h, positions, kv_caches, meta))
        rope = QueryScaledRope(self.rotary(positions, h.dtype), self.query_scale(positions))
        return run_pre_norm_layers(self.layers, self.norm, h, rope, kv_caches, meta)


class Ministral3ForCausalLM(MistralForCausalLM):
    model_class = Ministral3Model
    supports_quantized_gguf = False  # (module docstring)


__all__ = ["Llama4QueryScaling", "Ministral3ForCausalLM", "Ministral3Model", "QueryScaledRope",
           "llama4_query_scaling"]
