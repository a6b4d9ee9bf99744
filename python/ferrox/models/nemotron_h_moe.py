"""Nemotron-H's mixture-of-experts mixer (an "E" layer of hybrid_override_pattern: NVIDIA-Nemotron-3-Nano-30B-A3B,
Nemotron 3 Super), as transformers' NemotronHMoE computes it:

    weights, ids = route(x)                                  (float32 router, below)
    routed = fc2_latent_proj(experts(fc1_latent_proj(x), weights, ids))   (the projections with moe_latent_size)
    out = routed + shared_experts(x)

- router: logits in float32, sigmoid scores; e_score_correction_bias added for the choice only; experts grouped
  n_group ways, the best topk_group groups (each ranked by its two best biased scores) kept, the top
  num_experts_per_tok biased scores chosen; their weights the unbiased scores, renormalised (sum + 1e-20) with
  norm_topk_prob, times routed_scaling_factor. That is DeepSeek-V3's noaux_tc routing: layers/grouped_topk.py
  with the two-best group ranking, on the device with nothing read back (CUDA graphs keep the layer);
- experts: n_routed_experts non-gated MLPs down(relu(up y)^2), moe_intermediate_size wide, over y = x or its
  moe_latent_size-wide projection: a FusedMoE with activation Relu2 (layers/fused_moe.py; the fused Triton
  kernels on the GPU, grouped GEMMs or, for a few tokens, matrix-vector products per pair);
- shared expert: one ReLU^2 MLP of moe_shared_expert_intermediate_size on the un-projected x (models/ungated_mlp.py).

LoRA (lora/manager.py, lora/moe_targets.py): the experts' up / down pairs run inside FusedMoE (lora/moe.py, one slice
where gated experts have two), so they see the latent input the base experts see; the shared expert's projections and
the latent projections are wrapped as whole layers (fc2's delta joins the rank's partial sum it maps).

Tensor parallelism, as vLLM shards the layer: the router and e_score_correction_bias replicated (every rank routes
every token alike); the experts' intermediate rows split, or with --enable-expert-parallel whole experts
(layers/fused_moe.py); the shared expert column / row parallel (models/ungated_mlp.py); fc1_latent_proj and
fc2_latent_proj replicated (vLLM's ReplicatedLinear). A rank's routed output is then a partial sum: without a
latent projection the shared expert's partial joins it before one all-reduce (experts_with_shared); with one,
fc2_latent_proj maps the rank's latent partial sum (it is linear, so the ranks' products sum to the product of the
sum, its bias added by rank 0 alone: `PartialSumLinear`) and the shared partial joins that, again one all-reduce of
hidden width (vLLM reduces the latent sum before fc2 and the shared output apart: two).

n_shared_experts: transformers builds one shared expert whatever it says; vLLM multiplies the shared width by it
(none at 0). The two agree at 1, the releases' value; another is refused by name. moe_shared_expert_overlap is
a training option (overlapping the shared expert with the experts' communication) that neither reads at inference.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from ferrox.layers.fused_moe import FusedMoE, Relu2, TopKRouter, experts_with_shared
from ferrox.layers.grouped_topk import grouped_topk
from ferrox.layers.linear import Linear, float_linear
from ferrox.layers.ops import DeviceOps
from ferrox.model_spec import ModelLoadError, ModelSpec, UnsupportedModelError
from ferrox.models.ungated_mlp import ReluSquaredMLP


def _int(config: dict[str, Any], key: str, default: int | None = None) -> int:
    value = config.get(key)
    value = default if value is None else value
    if value is None:
        raise ModelLoadError(f"config.json: hybrid_override_pattern has 'E' layers, which need field {key!r}")
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ModelLoadError(f"config.json: field {key!r} must be an integer >= 1, got {value!r}")
    return value


@dataclasses.dataclass(frozen=True, slots=True)
class NemotronHMoeConfig:
    """config.json's fields of the E layers (module docstring), checked."""

    num_experts: int  # n_routed_experts
    top_k: int  # num_experts_per_tok
    intermediate_size: int  # moe_intermediate_size, of one expert
    shared_intermediate_size: int  # moe_shared_expert_intermediate_size
    latent_size: int | None  # moe_latent_size: the experts' width, None for hidden_size
    n_group: int
    topk_group: int
    renormalize: bool  # norm_topk_prob
    routed_scaling_factor: float

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> NemotronHMoeConfig:
        experts, top_k = _int(config, "n_routed_experts"), _int(config, "num_experts_per_tok")
        n_group, topk_group = _int(config, "n_group", 1), _int(config, "topk_group", 1)
        if experts % n_group:
            raise ModelLoadError(f"config.json: n_group {n_group} does not divide n_routed_experts {experts}")
        if topk_group > n_group:
            raise ModelLoadError(f"config.json: topk_group {topk_group} is more than n_group {n_group}")
        kept = topk_group * (experts // n_group)
        if top_k > kept:
            raise ModelLoadError(f"config.json: num_experts_per_tok {top_k} is more than the {kept} experts of the "
                                 f"topk_group {topk_group} groups a token keeps")
        shared = config.get("n_shared_experts")
        if shared is not None and shared != 1:
            raise UnsupportedModelError(f"config.json: n_shared_experts {shared!r} is not supported (1: transformers "
                                        "builds one shared expert whatever the field says, vLLM widens it n-fold)")
        latent = config.get("moe_latent_size")
        renormalize = config.get("norm_topk_prob", True)
        if not isinstance(renormalize, bool):
            raise ModelLoadError(f"config.json: norm_topk_prob must be true or false, got {renormalize!r}")
        scale = config.get("routed_scaling_factor", 1.0)
        scale = 1.0 if scale is None else scale
        if isinstance(scale, bool) or not isinstance(scale, int | float):
            raise ModelLoadError(f"config.json: routed_scaling_factor must be a number, got {scale!r}")
        return cls(num_experts=experts, top_k=top_k, intermediate_size=_int(config, "moe_intermediate_size"),
                   shared_intermediate_size=_int(config, "moe_shared_expert_intermediate_size"),
                   latent_size=None if latent is None else _int(config, "moe_latent_size"), n_group=n_group,
                   topk_group=topk_group, renormalize=renormalize, routed_scaling_factor=float(scale))


class NemotronHRouter(TopKRouter):
    """The float32 router and its e_score_correction_bias (both float32 in the checkpoint, as transformers keeps
    them)."""

    def __init__(self, hidden_size: int, num_experts: int, device: Any):
        super().__init__(hidden_size, num_experts, device)
        self.e_score_correction_bias = nn.Parameter(torch.zeros(num_experts, dtype=torch.float32, device=device),
                                                    requires_grad=False)


class PartialSumLinear(Linear):
    """A replicated projection applied to a rank's partial sum before the all-reduce (fc2_latent_proj on the routed
    experts' latent output): every rank holds the whole weight, rank 0 alone adds the bias, so the summed products
    have it once. With one rank, a plain Linear."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.bias if self.tp.rank == 0 else None
        return float_linear(x, self.weight, bias) if self.quant is None else self.quant(x, bias)


class NemotronHMoE(nn.Module):
    """The E layer's mixer: gate (router), experts, shared_experts and, with a latent size, fc1_latent_proj /
    fc2_latent_proj (the checkpoint's names under `mixer.`)."""

    def __init__(self, spec: ModelSpec, moe: NemotronHMoeConfig, ops: DeviceOps, dtype: torch.dtype, device: Any):
        super().__init__()
        self.moe = moe
        hidden = spec.hidden_size
        width = moe.latent_size or hidden
        self.gate = NemotronHRouter(hidden, moe.num_experts, device)
        self.experts = FusedMoE(moe.num_experts, width, moe.intermediate_size, dtype=dtype, device=device, ops=ops,
                                activation=Relu2())
        self.shared_experts = ReluSquaredMLP(dataclasses.replace(spec, intermediate_size=moe.shared_intermediate_size),
                                             ops, dtype, device)
        self.fc1_latent_proj: Linear | None = None
        self.fc2_latent_proj: PartialSumLinear | None = None
        if moe.latent_size is not None:
            self.fc1_latent_proj = Linear(hidden, width, bias=spec.mlp_bias, dtype=dtype, device=device)
            self.fc2_latent_proj = PartialSumLinear(width, hidden, bias=spec.mlp_bias, dtype=dtype, device=device)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights float32 [T, k], expert ids int32 [T, k]) of each token (module docstring)."""
        moe = self.moe
        return grouped_topk(self.gate(x), moe.top_k, scoring_func="sigmoid", renormalize=moe.renormalize,
                            num_expert_group=moe.n_group, topk_group=moe.topk_group,
                            e_score_correction_bias=self.gate.e_score_correction_bias,
                            routed_scaling_factor=moe.routed_scaling_factor, group_top2=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.route(x)
        if self.fc1_latent_proj is None or self.fc2_latent_proj is None:
            return experts_with_shared(self.experts, x, weights, ids, self.shared_experts, x)
        # Each term is this rank's partial (module docstring): one all-reduce sums them.
        routed = self.fc2_latent_proj(self.experts(self.fc1_latent_proj(x), weights, ids, reduce=False))
        return self.experts.tp.all_reduce(routed + self.shared_experts(x, reduce=False))

