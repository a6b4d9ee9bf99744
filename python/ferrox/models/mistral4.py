"""Mistral 4 (Mistral AI, Mar 2026: Mistral-Small-4-119B-2603, 119B MoE with 6.5B active), as transformers' `mistral4`
defines it: DeepSeek-V3's decoder (models/deepseek_v2.py: multi-head latent attention in the absorbed form, routed
plus shared experts, dense MLPs in the first `first_k_dense_replace` layers) with Ministral 3's rope
(models/ministral3.py), both read from config.json's `rope_parameters`:

- YaRN on the qk_rope_head_dim rotary dims (interleaved pairs unless `rope_interleave` is false), its
  mscale_all_dim also in the softmax scale as DeepSeek's (transformers' yarn_apply_mscale). The config's
  partial_rotary_factor (qk_rope / (qk_nope + qk_rope)) names those same dims (loader/model_config.py checks it).
- Llama 4's query scaling (`llama_4_scaling_beta`): each token's whole query, the unrotated dims and the rotated
  ones, times 1 + beta * ln(1 + floor(p / original_max_position_embeddings)); keys and values are not scaled.
  It rides the step's rope (`QueryScaledRope`) into MlaAttention, which multiplies q_nope and q_pe before the
  absorption (models/mla_attention.py), so every attention path reads the scaled query: the torch backend
  (CPU), the Triton MLA kernels (prefill and decode), the expanded FlashAttention-3 prefill, the decode and
  piecewise CUDA graphs (the factors come from the positions inside the captured forward), tensor parallelism
  (each rank its own heads). In the absorbed decode it is a per-token factor on the attention logits.
- The router (transformers' Mistral4TopkRouter): softmax scores; with n_group > 1 the groups ranked by the sum
  of their two best scores and the best topk_group kept; the top num_experts_per_tok scores name the experts,
  their weights renormalised (norm_topk_prob, default true) and times routed_scaling_factor. No correction
  bias; topk_method, scoring_func and moe_layer_freq are not read (transformers reads none of them): every
  layer from first_k_dense_replace on has experts.

Checkpoints: the per-expert names DeepSeek's loader reads (`mlp.experts.{e}.{gate,up,down}_proj.*`) or
transformers 5's stacked ones, unstacked at load: `mlp.experts.gate_up_proj` [E, 2I, H] (gate rows, then up)
and `mlp.experts.down_proj` [E, H, I], with the FP8 releases' per-expert scales beside them
(`gate_up_proj_scale_inv` [E, 1, 1], one for both halves, or [E, 2, 1], one each; `down_proj_scale_inv`;
`*_activation_scale` [E], the static input scales, which the experts read but do not use: they quantize their
inputs per token at run time, layers/quant/fp8.py). The attention and shared-expert projections take the
releases' per-tensor static FP8 as Ministral 3's do; kv_b_proj is dequantized for the absorption.

Mistral3ForConditionalGeneration with text_config.model_type "mistral4" (the hub's releases: the Pixtral tower
and Mistral 3's projector, in bf16) is `Mistral3Mistral4ForConditionalGeneration` (models/registry.py
TEXT_VARIANTS). Mistral Large 3 (transformers' `mistral_large4`: sparse attention with an indexer, shared KV
layers, a learned rope) is another architecture, not served here.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from ferrox.attention.backend import AttentionBackend
from ferrox.distributed.sharding import materialize, row_block
from ferrox.layers.fused_moe import FusedMoE
from ferrox.layers.ops import DeviceOps
from ferrox.model_spec import ModelLoadError, ModelSpec
from ferrox.models.deepseek_v2 import (
    DeepseekModel,
    DeepseekMoeConfig,
    DeepseekV3ForCausalLM,
    _field,
    _int,
    expert_groups,
)
from ferrox.models.llava import LlavaLayoutWeights
from ferrox.models.ministral3 import QueryScaledRope, llama4_query_scaling
from ferrox.models.mistral3 import PixtralImages, tied_from_top_level
from ferrox.models.mla_attention import MlaShape
from ferrox.models.pre_norm import run_pre_norm_layers

# transformers 5's stacked experts: <layer>.mlp.experts.{gate_up_proj,down_proj}[_scale_inv|_activation_scale]
_STACKED = re.compile(r"^(?P<experts>.+\.mlp\.experts)\.(?P<proj>gate_up_proj|down_proj)"
                      r"(?P<tail>|_scale_inv|_activation_scale)$")


def mistral4_moe(spec: ModelSpec) -> DeepseekMoeConfig:
    """The experts as transformers' Mistral4 routes them (module docstring)."""
    config = spec.hf_config
    experts, top_k, groups, topk_group = expert_groups(config)
    return DeepseekMoeConfig(
        num_experts=experts, top_k=top_k, intermediate_size=_int(config, "moe_intermediate_size"),
        num_shared_experts=_int(config, "n_shared_experts", 0, minimum=0),
        first_k_dense_replace=_int(config, "first_k_dense_replace", 0, minimum=0), moe_layer_freq=1,
        scoring_func="softmax", correction_bias=False, num_expert_group=groups, topk_group=topk_group,
        renormalize=bool(_field(config, "norm_topk_prob", True)),
        routed_scaling_factor=float(_field(config, "routed_scaling_factor", 1.0)), group_top2=True)


class Mistral4Model(DeepseekModel):
    """DeepSeek's stack with Llama 4's query scaling (module docstring)."""

    def __init__(self, spec: ModelSpec, mla: MlaShape, moe: DeepseekMoeConfig | None, backend: AttentionBackend,
                 ops: DeviceOps, dtype, device):
        super().__init__(spec, mla, moe, backend, ops, dtype, device)
        self.query_scale = llama4_query_scaling(spec.hf_config)

    def forward(self, input_ids, positions, kv_caches, meta, inputs_embeds=None):
        if self.query_scale is None:
            return super().forward(input_ids, positions, kv_caches, meta, inputs_embeds=inputs_embeds)
        h = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        rope = QueryScaledRope(self.rotary(positions, h.dtype), self.query_scale(positions))
        return run_pre_norm_layers(self.layers, self.norm, h, rope, kv_caches, meta)


class Mistral4ForCausalLM(DeepseekV3ForCausalLM):
    """Mistral 4's language model (module docstring); DeepSeek-V3's rotary fields (rope_interleave)."""

    model_class = Mistral4Model

    def read_moe(self, spec: ModelSpec) -> DeepseekMoeConfig:
        return mistral4_moe(spec)

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        """DeepSeek's loader over the checkpoint with transformers 5's stacked experts unstacked (module
        docstring)."""
        super().load_weights(self._unstacked(weights))

    def _unstacked(self, weights: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
        modules = dict(self.named_modules())
        for name, tensor in weights:
            match = _STACKED.match(name)
            experts = modules.get(match["experts"]) if match is not None else None
            if match is None or not isinstance(experts, FusedMoE):
                yield name, tensor
                continue
            base, tail = match["experts"], match["tail"]
            shards = ("gate", "up") if match["proj"] == "gate_up_proj" else ("down",)
            method = experts.weight_method
            leaf = {"": "weight", "_activation_scale": "input_scale"}.get(
                tail, getattr(method, "scale_param", "weight_scale"))
            if tensor.shape[0] != experts.num_experts:
                raise ModelLoadError(f"tensor {name!r}: {tensor.shape[0]} experts stacked, the layer has "
                                     f"{experts.num_experts}")
            for e in range(experts.num_experts):
                value = materialize(row_block(tensor, e, 1))[0]  # (one expert read at a time)
                for shard, part in zip(shards, _halves(value, len(shards), tail), strict=True):
                    yield f"{base}.{e}.{shard}_proj.{leaf}", part


def _halves(value: torch.Tensor, parts: int, tail: str) -> tuple[torch.Tensor, ...]:
    """One expert's stacked tensor for its `parts` shards: gate_up's rows halved (its weight, or row / block
    scales); a per-tensor scale (one value) or an input scale is both halves'; [2, 1] scales are one each."""
    if parts == 1:
        return (value,)
    if tail == "_activation_scale" or value.numel() == 1:
        return (value.reshape(()),) * 2
    if tail == "_scale_inv" and value.numel() == 2:
        flat = value.reshape(2)
        return flat[0], flat[1]
    half = value.shape[0] // 2
    return value[:half], value[half:]


class Mistral3Mistral4ForConditionalGeneration(PixtralImages, LlavaLayoutWeights, Mistral4ForCausalLM):
    """Mistral3ForConditionalGeneration over a `mistral4` text config (Mistral Small 4): the Pixtral tower and
    Mistral 3's projector (models/mistral3.py) over Mistral 4's stack, in LLaVA's checkpoint layout."""

    # Only the language model's layers take a quantization method (the tower and projector are plain torch).
    supports_quantization = True

    def __init__(self, spec: ModelSpec, dtype: torch.dtype, device: torch.device | str, *,
                 kernels: str | None = None):
        super().__init__(tied_from_top_level(spec), dtype, device, kernels=kernels)
        self.build_pixtral(spec, dtype, device)

    def _expected_keys(self) -> set[str]:
        """The language model's pieces (the tower and projector load apart: LlavaLayoutWeights)."""
        return {key for key in super()._expected_keys() if not key.startswith(self.own_weight_prefixes)}


__all__ = ["Mistral3Mistral4ForConditionalGeneration", "Mistral4ForCausalLM", "Mistral4Model", "mistral4_moe"]
