"""GLM-4.5, GLM-4.5-Air and GLM-4.6 (Glm4MoeForCausalLM) on the shared MoE stack (models/moe.py).

What differs from Qwen-MoE, as transformers' Glm4Moe defines it:

- routing (`Glm4MoeBlock.route`): sigmoid scores, DeepSeek-V3's grouped top-k with the
  `e_score_correction_bias` steering the choice (`n_group`, `topk_group`), the chosen experts weighted
  by their own scores, renormalised (`norm_topk_prob`), times `routed_scaling_factor`
  (layers/grouped_topk.py). The fused one-token decode path routes with softmax top-k, so these models
  decode through the general path (MoeBlock.fused_decode_routing); the experts still run in the fused
  Triton MoE kernels on GPU;
- `n_shared_experts` always-on experts as one plain MLP of moe_intermediate_size * n_shared_experts
  (`mlp.shared_experts`, no gate), added to the routed sum;
- the first `first_k_dense_replace` layers are dense (intermediate_size);
- q/k/v bias (`attention_bias`; o_proj never has one), optional per-head q/k RMSNorm (`use_qk_norm`:
  GLM-4.5 and 4.6 on, Air off);
- rotary over the first `partial_rotary_factor` (default 0.5) of each head, in the half-split layout
  (dim i pairs with i + rotary_dim / 2): q/k rows (and the q/k norm weights) reordered at load as for
  Phi-4-mini (layers/rotary.py partial_rotary_order).

The checkpoints carry `num_nextn_predict_layers` multi-token-prediction layers after the last decoder
layer (model.layers.{num_hidden_layers}...); the base model does not run them, and they are skipped at
load as vLLM skips them; speculative_config method 'mtp' drafts with the first (models/deepseek_mtp.py). Config names come from config.json with transformers' Glm4MoeConfig defaults.
Tensor and expert parallelism are the MoE stack's. The published FP8 checkpoints (block-wise, 128-row blocks of
128-dim heads) load as stored: a q/k row reordered inside its head stays in its block row, under its scale.
Refused by name: another checkpoint quantization_config (the q/k rows are permuted at load;
`quantization="fp8"` quantizes the loaded weights), a
`scoring_func` other than sigmoid or a `topk_method` other than noaux_tc (DeepSeek's names, which GLM
configs do not carry), and group counts that do not divide the experts. LoRA adapts the attention, the dense
layers' MLPs, the shared and the routed experts (lora/moe_targets.py), the adapters' q/k rows permuted as the
weights' (`lora_rewrite`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from ferrox.attention.backend import AttentionBackend, get_attention_backend
from ferrox.layers.fused_moe import TopKRouter, experts_with_shared
from ferrox.layers.grouped_topk import grouped_topk
from ferrox.layers.ops import DeviceOps
from ferrox.layers.rotary import partial_rotary_order
from ferrox.model_spec import ModelLoadError, ModelSpec, MoeSpec, UnsupportedModelError
from ferrox.models.deepseek_mtp import DeepseekLayoutMtpTarget
from ferrox.models.glm4 import (
    check_checkpoint_quantization,
    glm_spec,
    reorder_rotary_rows,
    without_mtp_layers,
)
from ferrox.models.llama import LlamaMLP
from ferrox.models.moe import MoeBlock, MoeDecoderLayer, MoeForCausalLM, MoeModel, load_moe_tensors

# transformers' Glm4MoeConfig defaults for the fields config.json may leave out.
_DEFAULTS: dict[str, Any] = {
    "n_routed_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 1408, "n_shared_experts": 1,
    "routed_scaling_factor": 1.0, "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1,
    "norm_topk_prob": True, "use_qk_norm": False, "num_nextn_predict_layers": 1,
}


def _field(config: dict[str, Any], key: str) -> Any:
    value = config.get(key)
    return _DEFAULTS[key] if value is None else value


def _int(config: dict[str, Any], key: str, minimum: int = 1) -> int:
    """config.json's integer `key` (transformers' default when absent), at least `minimum`."""
    value = _field(config, key)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ModelLoadError(f"config.json: field {key!r} must be an integer >= {minimum}, got {value!r}")
    return value


def _positive(config: dict[str, Any], key: str) -> float:
    value = _field(config, key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ModelLoadError(f"config.json: field {key!r} must be a positive number, got {value!r}")
    return float(value)


@dataclasses.dataclass(frozen=True, slots=True)
class GroupedRouting:
    """The router fields of a GLM-4.5 config (layers/grouped_topk.py)."""

    n_group: int
    topk_group: int
    routed_scaling_factor: float
    n_shared_experts: int

    @classmethod
    def from_config(cls, config: dict[str, Any], num_experts: int, top_k: int) -> GroupedRouting:
        where = "config.json"
        if config.get("scoring_func", "sigmoid") != "sigmoid":
            raise UnsupportedModelError(f"{where}: scoring_func {config['scoring_func']!r} is not supported for "
                                        "Glm4MoeForCausalLM (its router scores with sigmoid)")
        if config.get("topk_method", "noaux_tc") != "noaux_tc":
            raise UnsupportedModelError(f"{where}: topk_method {config['topk_method']!r} is not supported for "
                                        "Glm4MoeForCausalLM (noaux_tc: grouped top-k with e_score_correction_bias)")
        n_group, topk_group = _int(config, "n_group"), _int(config, "topk_group")
        if num_experts % n_group or not 1 <= topk_group <= n_group:
            raise UnsupportedModelError(f"{where}: n_group {n_group} / topk_group {topk_group} do not split the "
                                        f"{num_experts} n_routed_experts into groups to choose from")
        if top_k > topk_group * (num_experts // n_group):
            raise UnsupportedModelError(f"{where}: num_experts_per_tok {top_k} is more than the experts of the "
                                        f"topk_group {topk_group} groups kept")
        return cls(n_group=n_group, topk_group=topk_group,
                   routed_scaling_factor=_positive(config, "routed_scaling_factor"),
                   n_shared_experts=_int(config, "n_shared_experts", 0))


class GroupedTopKRouter(TopKRouter):
    """The float32 router with DeepSeek-V3's per-expert correction bias (checkpoint name
    `e_score_correction_bias`; float32 in the released checkpoints)."""

    def __init__(self, hidden_size: int, num_experts: int, device: torch.device | str | None = None):
        super().__init__(hidden_size, num_experts, device)
        self.e_score_correction_bias = nn.Parameter(torch.zeros(num_experts, dtype=torch.float32, device=device),
                                                    requires_grad=False)


class Glm4MoeBlock(MoeBlock):
    """GLM-4.5's sparse MLP: grouped sigmoid top-k over the routed experts, plus ungated shared experts."""

    fused_decode_routing = False
    gate: GroupedTopKRouter

    def __init__(self, spec: ModelSpec, moe: MoeSpec, ops: DeviceOps, dtype, device, *, renormalize: bool):
        super().__init__(spec, moe, ops, dtype, device, renormalize=renormalize)
        self.routing = GroupedRouting.from_config(spec.hf_config, moe.num_experts, moe.num_experts_per_tok)
        self.gate = GroupedTopKRouter(spec.hidden_size, moe.num_experts, device)
        self.shared_experts: LlamaMLP | None = None
        if self.routing.n_shared_experts:
            shared = dataclasses.replace(spec, intermediate_size=moe.intermediate_size * self.routing.n_shared_experts)
            self.shared_experts = LlamaMLP(shared, ops, dtype, device)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        r = self.routing
        return grouped_topk(self.gate(x), self.top_k, scoring_func="sigmoid", renormalize=self.renormalize,
                            num_expert_group=r.n_group, topk_group=r.topk_group,
                            e_score_correction_bias=self.gate.e_score_correction_bias,
                            routed_scaling_factor=r.routed_scaling_factor)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.shared_experts is None:
            return super().forward(x)
        weights, ids = self.route(x)
        return experts_with_shared(self.experts, x, weights, ids, self.shared_experts, x)


class Glm4MoeModel(MoeModel):
    block_class = Glm4MoeBlock


def glm4_moe_spec(spec: ModelSpec) -> ModelSpec:
    """The spec the MoE stack reads: the experts from GLM's config names, the first
    first_k_dense_replace layers dense, q/k/v bias only (spec.attention_bias is o_proj's too in the
    stack: Glm4MoeForCausalLM.qkv_bias reads config.json), and GLM's default rotary width."""
    config = spec.hf_config
    num_experts, top_k = _int(config, "n_routed_experts"), _int(config, "num_experts_per_tok")
    if top_k > num_experts:
        raise ModelLoadError(f"config.json: num_experts_per_tok {top_k} is more than the {num_experts} "
                             "n_routed_experts")
    first_dense = _int(config, "first_k_dense_replace", 0)
    moe = MoeSpec(num_experts=num_experts, num_experts_per_tok=top_k,
                  intermediate_size=_int(config, "moe_intermediate_size"),
                  norm_topk_prob=bool(_field(config, "norm_topk_prob")),
                  mlp_only_layers=tuple(range(min(first_dense, spec.num_layers))))
    return dataclasses.replace(glm_spec(spec), moe=moe, attention_bias=False)


class Glm4MoeForCausalLM(DeepseekLayoutMtpTarget, MoeForCausalLM):
    model_class = Glm4MoeModel
    reorders_partial_rotary = True

    def __init__(self, spec: ModelSpec, dtype: torch.dtype, device: torch.device | str, *,
                 kernels: str | None = None):
        spec = glm4_moe_spec(spec)
        assert spec.moe is not None
        rotary_dim = spec.rotary_dim
        order = None if rotary_dim is None else partial_rotary_order(spec.head_dim, rotary_dim)
        check_checkpoint_quantization(spec, order, block_fp8=True)  # (the published FP8 checkpoints: block-wise)
        GroupedRouting.from_config(spec.hf_config, spec.moe.num_experts, spec.moe.num_experts_per_tok)  # (checks)
        super().__init__(spec, dtype, device, kernels=kernels)
        self.rotary_order = order
        self.num_mtp_layers = _int(spec.hf_config, "num_nextn_predict_layers", 0)

    @property
    def qk_norm(self) -> bool:  # type: ignore[override]  # (a class attribute in MoeForCausalLM)
        """GLM-4.5 / 4.6: per-head RMSNorm of q and k (use_qk_norm); Air: none."""
        return bool(_field(self.spec.hf_config, "use_qk_norm"))

    @staticmethod
    def qkv_bias(spec: ModelSpec) -> bool:
        return bool(spec.hf_config.get("attention_bias", False))

    def mtp_decoder_layer(self, index: int) -> tuple[AttentionBackend, nn.Module]:
        """(An attention backend of its own, the MTP layer's decoder layer: one of this model's, sparse.)"""
        backend = get_attention_backend(self.lm_head_weight.device, self.kernels)
        model, spec = self.model, self.spec
        assert spec.moe is not None
        dtype = model.embed_tokens.weight.dtype
        return backend, MoeDecoderLayer(spec, index, backend, self.ops, dtype, self.lm_head_weight.device,
                                        qkv_bias=self.qkv_bias(spec), qk_norm=self.qk_norm,
                                        renormalize=self.always_renormalize or spec.moe.norm_topk_prob,
                                        block_class=model.block_class, attention_class=model.attention_class)

    def load_mtp_tensors(self, mtp: nn.Module, weights: Iterable[tuple[str, Any]], expected: set[str]) -> None:
        """The MTP layer's tensors into `mtp`, with this model's q / k row order."""
        load_moe_tensors(mtp, reorder_rotary_rows(weights, self.spec.head_dim, self.rotary_order),
                         self.spec.architecture, expected)

    def _rows_rewritten(self, weights: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
        return reorder_rotary_rows(without_mtp_layers(weights, self.spec.num_layers, self.num_mtp_layers),
                                   self.spec.head_dim, self.rotary_order)

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        super().load_weights(self._rows_rewritten(weights))

    def lora_rewrite(self, pairs: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
        """Adapters' (module.weight, lora_B) pairs with the checkpoint's row edits (lora/rewrite.py): the MTP
        layers' dropped (the model runs no LoRA there), q/k rows permuted (row-only)."""
        return self._rows_rewritten(pairs)
