"""The routed experts of an MoE layer: a router, top-k selection, and the experts as two stacked tensors.

Checkpoints store one small MLP per expert (`experts.{e}.gate_proj/up_proj/down_proj`, Mixtral
`w1/w3/w2`); the layer stacks them while loading, w13 [E, 2*I, H] (gate rows, then up rows) and
w2 [E, H, I], so a step is two grouped launches (kernels/fused_moe.py) rather than E matmuls.
Every checkpoint tensor arrives through `FusedMoE.load_expert_weight`: the one place that will
decide which slice a rank keeps once experts are sharded or split across ranks.

The implementation is chosen once, from the kernel set the model was built with (layers/ops.py):
the Triton kernels, or a plain per-expert loop in torch (CPU, and the kernels' reference).
Quantized experts (FP8, per row or per block: layers/quant/fp8_moe.py) are held by the model's
quantization method, which replaces w13 / w2 with their codes and adds w13_scale / w2_scale; the
same kernels take them (the torch loop: layers/quant/fp8_moe_ref.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from ferrox.distributed.parallel_state import TPGroup, get_tp_group
from ferrox.distributed.sharding import Weight, even_split, materialize, narrow, shape_of
from ferrox.layers.expert_loop import per_expert
from ferrox.layers.ops import DeviceOps, silu_and_mul_torch
from ferrox.layers.quant.fp8_moe_ref import experts_fp8_torch
from ferrox.layers.quant.method import get_quant_config

if TYPE_CHECKING:
    from ferrox.layers.quant.fp8_moe import Fp8MoeMethod


class TopKRouter(nn.Module):
    """Router logits in float32: the weight is kept in fp32 (E x H, small) so near-tied experts are
    ranked the same whatever the activation dtype."""

    def __init__(self, hidden_size: int, num_experts: int, device: torch.device | str | None = None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=torch.float32, device=device),
                                   requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.float(), self.weight)


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over all experts, keep the top k; with `renormalize` (Mixtral, Qwen3-MoE's
    norm_topk_prob) the k weights are rescaled to sum to 1. Returns (weights float32 [T, k],
    expert ids int64 [T, k])."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def experts_torch(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor) -> torch.Tensor:
    """Per-expert loop (correct, not fast): the CPU path and the kernels' reference."""

    def expert_fn(expert: int, tokens: torch.Tensor) -> torch.Tensor:
        return F.linear(silu_and_mul_torch(F.linear(x[tokens], w13[expert])), w2[expert])

    return per_expert(x, topk_weights, topk_ids, w13.shape[0], expert_fn)


class FusedMoE(nn.Module):
    """E experts of intermediate size I over hidden size H; forward(x, topk_weights, topk_ids).

    Under tensor parallelism (the group it is built in) either every rank holds all experts with
    I/N of each one's intermediate rows (w13) and columns (w2), or, with the group's
    expert_parallel, E/N whole experts. Either way a rank's output is a partial sum over its
    share, and one all-reduce completes it (tokens are replicated across the ranks already, so
    no all-to-all is needed)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, *, dtype: torch.dtype,
                 device: torch.device | str | None, ops: DeviceOps):
        super().__init__()
        self.tp: TPGroup = get_tp_group()
        tp = self.tp
        self.num_experts = num_experts  # in the checkpoint
        self.checkpoint_intermediate_size = intermediate_size
        self.expert_start, self.num_local_experts = 0, num_experts
        self.inter_start, self.intermediate_size = 0, intermediate_size  # this rank's rows of each expert
        if tp.size > 1 and tp.expert_parallel:
            self.expert_start, self.num_local_experts = even_split(num_experts, tp.size, tp.rank, "num_experts")
        elif tp.size > 1:
            self.inter_start, self.intermediate_size = even_split(intermediate_size, tp.size, tp.rank,
                                                                  "moe_intermediate_size")
        self.hidden_size = hidden_size
        inter, local = self.intermediate_size, self.num_local_experts
        # Quantized experts (layers/quant/fp8_moe.py): the method loads and holds w13 / w2 in its
        # dtype with their scales; an online method lets the float experts load first.
        quant = get_quant_config()
        self.weight_method: Fp8MoeMethod | None = quant.moe_method(self) if quant is not None else None
        self.w13_scale: torch.Tensor | None = None
        self.w2_scale: torch.Tensor | None = None
        self.w13: torch.Tensor
        self.w2: torch.Tensor
        if self.weight_method is not None:
            self.weight_method.check(self)
        if self.weight_method is None or self.weight_method.float_weight:
            self.w13 = nn.Parameter(torch.empty(local, 2 * inter, hidden_size, dtype=dtype, device=device),
                                    requires_grad=False)
            self.w2 = nn.Parameter(torch.empty(local, hidden_size, inter, dtype=dtype, device=device),
                                   requires_grad=False)
        else:
            self.weight_method.allocate(self, device)
        self.triton = ops.name == "triton"  # the fused kernels (else the per-expert loop)

    def set_expert_tensors(self, w13: torch.Tensor, w2: torch.Tensor, w13_scale: torch.Tensor,
                           w2_scale: torch.Tensor) -> None:
        """Quantized experts in place of the float parameters (buffers: nothing to train or init)."""
        for name, value in (("w13", w13), ("w2", w2), ("w13_scale", w13_scale), ("w2_scale", w2_scale)):
            self._parameters.pop(name, None)
            if name in self._buffers:
                self._buffers[name] = value
            else:
                self.__dict__.pop(name, None)
                self.register_buffer(name, value, persistent=False)

    @property
    def block(self) -> tuple[int, int] | None:
        """Quantized experts' scale block (None: a scale per row, or float experts)."""
        return self.weight_method.block if self.weight_method is not None else None

    def route(self, router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """`select_experts` on the layer's kernel set: on Triton one launch (`route_top_k`; torch's
        softmax, topk and renormalisation are ~5), which matters in eager steps (host-bound at
        short prompts) and in the decode graphs of 16+ tokens (48 layers of tiny kernels)."""
        if self.triton:
            from ferrox.kernels.fused_moe import route_top_k

            return route_top_k(router_logits, top_k, renormalize)
        return select_experts(router_logits, top_k, renormalize)

    def run_experts(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, *,
                    residual: torch.Tensor | None = None, small_batch: bool | None = None) -> torch.Tensor:
        """This rank's experts on x (ids local to the rank), the kernels of the layer's device and
        weights; the residual added (the fused decode path's h + mlp(h)). No all-reduce."""
        if self.triton:  # (float experts: no scales, no block)
            from ferrox.kernels.fused_moe import fused_moe

            return fused_moe(x, self.w13, self.w2, topk_weights, topk_ids, residual=residual, small_batch=small_batch,
                             w13_scale=self.w13_scale, w2_scale=self.w2_scale, block=self.block)
        if self.w13_scale is None or self.w2_scale is None:
            out = experts_torch(x, self.w13, self.w2, topk_weights, topk_ids)
        else:
            out = experts_fp8_torch(x, self.w13, self.w13_scale, self.w2, self.w2_scale, topk_weights, topk_ids,
                                    self.block)
        return out if residual is None else out + residual

    def expected_weights(self) -> set[tuple[int, str, str]]:
        """(expert, shard, leaf) triples a checkpoint must provide: gate, up and down of every
        expert, each its `weight` or the quantized method's tensors."""
        method = self.weight_method
        leaves = ("weight",) if method is None or method.float_weight else method.checkpoint_params
        return {(e, shard, leaf) for e in range(self.num_experts) for shard in ("gate", "up", "down")
                for leaf in leaves}

    def load_expert_weight(self, param_name: str, expert_id: int, shard: str, tensor: Weight) -> None:
        """Copy one expert's checkpoint tensor in: shard "gate" / "up" ([I, H], into w13's halves)
        or "down" ([H, I], into w2), or a quantized method's scale for them; this rank's part only.
        An expert held by another rank (expert parallelism) is skipped. param_name is the
        checkpoint leaf ("weight", "weight_scale_inv", ...)."""
        method = self.weight_method
        if method is not None and method.float_weight:
            method = None  # (online: float experts load as unquantized ones)
        known = (*method.checkpoint_params, *method.optional_params) if method is not None else ("weight",)
        if param_name not in known:
            raise ValueError(f"expert {expert_id} {shard}: unexpected parameter {param_name!r}")
        if not 0 <= expert_id < self.num_experts:
            raise ValueError(f"expert {expert_id} is out of range (the layer has {self.num_experts})")
        if shard not in ("gate", "up", "down"):
            raise ValueError(f"unknown expert shard {shard!r} (gate, up or down)")
        full, hidden = self.checkpoint_intermediate_size, self.hidden_size
        expected = (hidden, full) if shard == "down" else (full, hidden)
        if param_name == "weight" and shape_of(tensor) != expected:
            raise ValueError(f"expert {expert_id} {shard}: checkpoint shape {shape_of(tensor)}, model expects "
                             f"{expected}")
        local = expert_id - self.expert_start
        if not 0 <= local < self.num_local_experts:
            return  # another rank's expert
        if method is not None:
            method.load(self, param_name, local, shard, tensor)
            return
        inter = self.intermediate_size
        if inter == full:
            value = materialize(tensor)
        else:  # this rank's intermediate rows (gate/up) or columns (down)
            value = narrow(tensor, 1 if shard == "down" else 0, self.inter_start, inter)
        if shard == "gate":
            self.w13.data[local, :inter].copy_(value)
        elif shard == "up":
            self.w13.data[local, inter:].copy_(value)
        else:
            self.w2.data[local].copy_(value)

    def finalize_quantized(self) -> None:
        """After loading: an online method quantizes the float experts."""
        if self.weight_method is not None:
            self.weight_method.finalize(self)

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        if self.num_local_experts != self.num_experts:
            local = topk_ids - self.expert_start
            mine = (local >= 0) & (local < self.num_local_experts)
            if not self.triton:
                # Other ranks' experts become the id past this rank's last one, which the loop skips.
                topk_ids = torch.where(mine, local, torch.full_like(local, self.num_local_experts))
            else:
                # The fused kernel's expert sort has no "not on this rank" bucket: another rank's pair
                # runs local expert 0 with routing weight 0, so it adds nothing (the work is wasted:
                # a skip bucket in align_by_expert would save it).
                topk_ids = torch.where(mine, local, torch.zeros_like(local))
                topk_weights = torch.where(mine, topk_weights, torch.zeros_like(topk_weights))
        return self.tp.all_reduce(self.run_experts(x, topk_weights, topk_ids))
