"""ERNIE 4.5 mixture of experts (baidu/ERNIE-4.5-21B-A3B-PT, -300B-A47B-PT: Ernie4_5_MoeForCausalLM), as transformers'
Ernie4_5_Moe defines it: ERNIE 4.5's attention (models/ernie4_5.py: `use_bias`, interleaved rotary rows reordered
at load) over the MoE stack (models/moe.py), with

- sparse layers where (index + 1) % moe_layer_interval == 0 and moe_layer_start_index <= index <=
  moe_layer_end_index (-1: the last layer); the others a dense MLP of intermediate_size;
- routing: softmax over moe_num_experts in float32; the moe_k experts chosen by probability plus the
  aux-free balancing bias (`moe_statics.e_score_correction_bias`), weighted by their probabilities over
  max(their sum, moe_norm_min);
- moe_num_shared_experts always-on experts, one MLP of that many times moe_intermediate_size, ungated.

The checkpoint's multi-token-prediction tensors (`mtp_*`) are skipped, as transformers skips them. One-token
steps take the general path (the fused decode routes without the bias). Refused by name: `use_bias` (transformers'
lm_head then has a bias; no release sets it), a checkpoint quantization_config, GGUF files. LoRA adapts the attention
(q/k rows permuted as the weights': models/glm4.py InterleavedRotaryRows.lora_rewrite), the dense MLPs, the shared and
the routed experts (lora/moe_targets.py).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from ferrox.config_fields import to_float, to_int
from ferrox.layers.fused_moe import experts_with_shared
from ferrox.layers.ops import DeviceOps
from ferrox.model_spec import ModelLoadError, ModelSpec, MoeSpec, UnsupportedModelError
from ferrox.models.ernie4_5 import ernie_spec
from ferrox.models.glm4 import InterleavedRotaryRows, interleaved_rotary_setup
from ferrox.models.llama import LlamaMLP
from ferrox.models.moe import MoeBlock, MoeForCausalLM, MoeModel

# transformers' Ernie4_5_MoeConfig defaults.
_DEFAULTS = {"moe_k": 6, "moe_num_shared_experts": 2, "moe_layer_start_index": 1, "moe_layer_end_index": -1,
             "moe_layer_interval": 1, "moe_norm_min": 1e-12}
_MTP_TENSOR = re.compile(r"(^|\.)mtp")


def _int(config: dict[str, Any], key: str, minimum: int = 0) -> int:
    value = config.get(key, _DEFAULTS.get(key))
    if value is None:
        raise ModelLoadError(f"config.json: required field {key!r} is missing")
    return to_int(value, f"config.json: field {key!r}", minimum=minimum)


def sparse_layers(config: dict[str, Any], num_layers: int) -> tuple[bool, ...]:
    """Which layers route to experts (module docstring)."""
    start, interval = _int(config, "moe_layer_start_index"), _int(config, "moe_layer_interval", 1)
    end = config.get("moe_layer_end_index", -1)
    end = num_layers - 1 if end == -1 else to_int(end, "config.json: field 'moe_layer_end_index'", minimum=0)
    return tuple((i + 1) % interval == 0 and start <= i <= end for i in range(num_layers))


def ernie_moe_spec(spec: ModelSpec) -> ModelSpec:
    config = spec.hf_config
    num_experts, top_k = _int(config, "moe_num_experts", 1), _int(config, "moe_k", 1)
    if top_k > num_experts:
        raise ModelLoadError(f"config.json: moe_k {top_k} is more than the {num_experts} moe_num_experts")
    sparse = sparse_layers(config, spec.num_layers)
    moe = MoeSpec(num_experts=num_experts, num_experts_per_tok=top_k,
                  intermediate_size=_int(config, "moe_intermediate_size", 1), norm_topk_prob=True,
                  mlp_only_layers=tuple(i for i, s in enumerate(sparse) if not s))
    return dataclasses.replace(ernie_spec(spec), moe=moe)


class _MoeStatics(nn.Module):
    """The checkpoint's `mlp.moe_statics`: the balancing bias added to the probabilities that choose the experts."""

    def __init__(self, num_experts: int, device: torch.device | str | None):
        super().__init__()
        self.e_score_correction_bias = nn.Parameter(torch.zeros(1, num_experts, dtype=torch.float32, device=device),
                                                    requires_grad=False)


class Ernie4_5MoeBlock(MoeBlock):
    fused_decode_routing = False  # (the fused one-token path routes without the balancing bias)

    def __init__(self, spec: ModelSpec, moe: MoeSpec, ops: DeviceOps, dtype, device, *, renormalize: bool):
        super().__init__(spec, moe, ops, dtype, device, renormalize=renormalize)
        config = spec.hf_config
        self.moe_statics = _MoeStatics(moe.num_experts, device)
        self.norm_min = to_float(config.get("moe_norm_min", _DEFAULTS["moe_norm_min"]), "config.json: moe_norm_min")
        shared = _int(config, "moe_num_shared_experts")
        self.shared_experts: LlamaMLP | None = None
        if shared:
            self.shared_experts = LlamaMLP(dataclasses.replace(spec, intermediate_size=moe.intermediate_size * shared),
                                           ops, dtype, device)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        probs = torch.softmax(self.gate(x), dim=-1)  # (float32 logits: TopKRouter)
        _, ids = torch.topk(probs + self.moe_statics.e_score_correction_bias, self.top_k, dim=-1)
        weights = probs.gather(1, ids)
        return weights / weights.sum(dim=-1, keepdim=True).clamp(min=self.norm_min), ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.route(x)
        if self.shared_experts is None:
            return self.experts(x, weights, ids)
        return experts_with_shared(self.experts, x, weights, ids, self.shared_experts, x)


class Ernie4_5MoeModel(MoeModel):
    block_class = Ernie4_5MoeBlock


def without_mtp(weights: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
    return ((name, tensor) for name, tensor in weights if not _MTP_TENSOR.search(name))


class Ernie4_5_MoeForCausalLM(InterleavedRotaryRows, MoeForCausalLM):
    model_class = Ernie4_5MoeModel

    def __init__(self, spec: ModelSpec, dtype: torch.dtype, device: torch.device | str, *,
                 kernels: str | None = None):
        if spec.hf_config.get("use_bias"):
            raise UnsupportedModelError("config.json: use_bias true is not supported for Ernie4_5_MoeForCausalLM "
                                        "(transformers' lm_head then carries a bias too; the released checkpoints "
                                        "have none)")
        spec = ernie_moe_spec(spec)
        order = interleaved_rotary_setup(spec)
        super().__init__(spec, dtype, device, kernels=kernels)
        self.rotary_order = order

    def rotary_stream(self, weights: Iterable[tuple[str, Any]]) -> Iterable[tuple[str, Any]]:
        return without_mtp(weights)


__all__ = ["Ernie4_5_MoeForCausalLM"]
