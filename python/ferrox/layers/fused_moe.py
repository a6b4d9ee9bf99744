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

gpt-oss's experts (models/gpt_oss.py) add two options, in the torch loop and the kernels alike: a
bias per expert on both products (w13_bias [E, 2I], w2_bias [E, H]) and their own activation
(`SwigluOai`: clamped gate and up, gate * sigmoid(alpha * gate) * (up + 1)) in place of SiLU-and-mul.
Families without them build the layer as before and run the same code.

Gemma 4's experts (models/gemma4.py) gate with GELU-tanh (`GeluTanh`: gelu_tanh(gate) * up) in place of
SiLU, likewise in the torch loop and the kernels; float experts (the kernels take FP8 ones too, but no FP8
Gemma 4 checkpoint exists to test the layer with, so it refuses GELU-tanh with FP8 experts).

Nemotron-H's experts (models/nemotron_h_moe.py) are not gated: down(relu(up x)^2) (`Relu2`). Their w13 is
[E, I, H], the up rows alone, loaded from each expert's `up_proj` (or a stacked [E, I, H] tensor); the
kernels run it with GATED off (kernels/fused_moe.py RELU2), the torch loop with the same activation. Float or
FP8 experts (ModelOpt's FP8 Nemotron 3 releases; layers/quant/fp8_moe.py), without biases.

MXFP4 experts (gpt-oss's published checkpoints, `mxfp4=True`): on a kernel set that multiplies them
the layer holds the checkpoint's packed codes and scales (layers/quant/mxfp4_moe.py: w13 / w2 uint8 and
uint8 w13_scale / w2_scale) and the kernels dequantize in their K loops; elsewhere the model loads the
experts dequantized into the float parameters (`weight_method` None), as it always has.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from ferrox.distributed.parallel_state import TPGroup, get_tp_group
from ferrox.distributed.sharding import Weight, even_split, materialize, narrow, row_block, shape_of
from ferrox.layers.expert_loop import per_expert
from ferrox.layers.linear import RowParallelLinear
from ferrox.layers.ops import DeviceOps, silu_and_mul_torch
from ferrox.layers.quant.fp8_moe_ref import experts_fp8_torch
from ferrox.layers.quant.method import get_quant_config
from ferrox.layers.quant.mxfp4_moe import Mxfp4MoeMethod

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


@dataclass(frozen=True, slots=True)
class SwigluOai:
    """gpt-oss's expert activation (transformers' GptOssExperts._apply_gate; vLLM's "swigluoai") over
    [gate | up]: gate clamped above at `limit`, up to [-limit, limit], then
    gate * sigmoid(alpha * gate) * (up + 1)."""

    alpha: float = 1.702
    limit: float = 7.0


@dataclass(frozen=True, slots=True)
class GeluTanh:
    """Gemma 4's expert activation over [gate | up]: gelu_tanh(gate) * up (transformers' Gemma4TextExperts
    with gelu_pytorch_tanh)."""


@dataclass(frozen=True, slots=True)
class Relu2:
    """Nemotron-H's non-gated expert activation: relu(up)^2 over the up rows alone (transformers' NemotronHExperts
    with mlp_hidden_act relu2; vLLM's "relu2" without a mul). The layer's w13 then holds I rows, not 2I."""


# An MoE layer's activation: None is SiLU-and-mul (every SwiGLU family); all but Relu2 are gated.
ExpertActivation = SwigluOai | GeluTanh | Relu2 | None


def swiglu_oai_torch(gate_up: torch.Tensor, act: SwigluOai) -> torch.Tensor:
    """SwigluOai of [..., 2I] rows (gate half first), in their dtype as transformers computes it."""
    gate, up = gate_up.chunk(2, dim=-1)
    gate = gate.clamp(max=act.limit)
    up = up.clamp(min=-act.limit, max=act.limit)
    return (up + 1) * (gate * torch.sigmoid(gate * act.alpha))


def gelu_tanh_and_mul_torch(gate_up: torch.Tensor) -> torch.Tensor:
    """GeluTanh of [..., 2I] rows (gate half first), in their dtype as transformers computes it."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def gated_activation_torch(gate_up: torch.Tensor, activation: ExpertActivation) -> torch.Tensor:
    """The layer's activation over [..., 2I] rows (gate half first); Relu2's over [..., I] up rows."""
    if activation is None:
        return silu_and_mul_torch(gate_up)
    if isinstance(activation, Relu2):
        return torch.square(F.relu(gate_up))
    if isinstance(activation, GeluTanh):
        return gelu_tanh_and_mul_torch(gate_up)
    return swiglu_oai_torch(gate_up, activation)


def experts_torch(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, *, w13_bias: torch.Tensor | None = None,
                  w2_bias: torch.Tensor | None = None, activation: ExpertActivation = None) -> torch.Tensor:
    """Per-expert loop (correct, not fast): the CPU path and the kernels' reference. Biases: gpt-oss's
    (module docstring); the activation: gpt-oss's, Gemma 4's or Nemotron-H's (Relu2: w13 [E, I, H]), None for
    SiLU-and-mul."""

    def expert_fn(expert: int, tokens: torch.Tensor) -> torch.Tensor:
        gate_up = F.linear(x[tokens], w13[expert], w13_bias[expert] if w13_bias is not None else None)
        act = gated_activation_torch(gate_up, activation)
        return F.linear(act, w2[expert], w2_bias[expert] if w2_bias is not None else None)

    return per_expert(x, topk_weights, topk_ids, w13.shape[0], expert_fn)


class FusedMoE(nn.Module):
    """E experts of intermediate size I over hidden size H; forward(x, topk_weights, topk_ids).

    Under tensor parallelism (the group it is built in) either every rank holds all experts with
    I/N of each one's intermediate rows (w13) and columns (w2), or, with the group's
    expert_parallel, E/N whole experts. Either way a rank's output is a partial sum over its
    share, and one all-reduce completes it (tokens are replicated across the ranks already, so
    no all-to-all is needed)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, *, dtype: torch.dtype,
                 device: torch.device | str | None, ops: DeviceOps, bias: bool = False,
                 activation: ExpertActivation = None, mxfp4: bool = False):
        """bias / activation: gpt-oss's options (module docstring; float or MXFP4 experts), Gemma 4's
        GeluTanh activation or Nemotron-H's non-gated Relu2 (float experts). mxfp4: the checkpoint stores the
        experts in MXFP4 (kept so where the kernel set multiplies them)."""
        super().__init__()
        self.tp: TPGroup = get_tp_group()
        tp = self.tp
        self.activation = activation
        # w13 holds [gate | up] rows, or (Relu2) the up rows alone.
        self.gated = not isinstance(activation, Relu2)
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
        self.weight_method: Fp8MoeMethod | Mxfp4MoeMethod | None = (
            quant.moe_method(self) if quant is not None else None)
        if mxfp4:
            if self.weight_method is not None:
                raise ValueError("MXFP4 experts take no other quantization method")
            self.weight_method = Mxfp4MoeMethod.for_layer(self, ops)
        self.w13_scale: torch.Tensor | None = None
        self.w2_scale: torch.Tensor | None = None
        self.w13: torch.Tensor
        self.w2: torch.Tensor
        if self.weight_method is not None:
            self.weight_method.check(self)
        if activation is not None and not isinstance(activation, Relu2) and self.weight_method is not None and (
                not isinstance(self.weight_method, Mxfp4MoeMethod)):
            raise ValueError(f"{type(activation).__name__} experts are supported unquantized (FP8 experts: SiLU-and-mul "
                             "or Relu2)")
        if isinstance(activation, GeluTanh | Relu2) and mxfp4:
            raise ValueError(f"{type(activation).__name__} experts are supported unquantized, not MXFP4")
        if not self.gated and bias:
            raise ValueError("Relu2 (non-gated) experts take no biases")
        if self.weight_method is None or self.weight_method.float_weight:
            rows = 2 * inter if self.gated else inter
            self.w13 = nn.Parameter(torch.empty(local, rows, hidden_size, dtype=dtype, device=device),
                                    requires_grad=False)
            self.w2 = nn.Parameter(torch.empty(local, hidden_size, inter, dtype=dtype, device=device),
                                   requires_grad=False)
        else:
            self.weight_method.allocate(self, device)
        self.w13_bias: torch.Tensor | None = None
        self.w2_bias: torch.Tensor | None = None
        if bias:
            if self.weight_method is not None and not isinstance(self.weight_method, Mxfp4MoeMethod):
                raise ValueError("expert biases are supported for float and MXFP4 experts only")
            self.w13_bias = nn.Parameter(torch.empty(local, 2 * inter, dtype=dtype, device=device),
                                         requires_grad=False)
            self.w2_bias = nn.Parameter(torch.empty(local, hidden_size, dtype=dtype, device=device),
                                        requires_grad=False)
        self.triton = ops.name == "triton"  # the fused kernels (else the per-expert loop)
        # LoRA on the experts (lora/moe.py LoRAExperts), hooked in by the LoRA manager: it then runs the experts
        # with each token's adapter delta. None: the experts run as below.
        self.lora: nn.Module | None = None

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
        if self.lora is not None:
            return self.lora(self, x, topk_weights, topk_ids, residual=residual)
        act = self.activation
        if self.triton:  # (float and MXFP4 experts: no block)
            from ferrox.kernels.fused_moe import Activation, fused_moe

            options: dict[str, Any] = {}
            if self.w13_bias is not None or isinstance(act, SwigluOai):  # gpt-oss's
                options.update(w13_bias=self.w13_bias, w2_bias=self.w2_bias,
                               swiglu_oai=(act.alpha, act.limit) if isinstance(act, SwigluOai) else None)
            if isinstance(act, GeluTanh):
                options.update(activation=Activation.GELU_TANH)
            elif isinstance(act, Relu2):
                options.update(activation=Activation.RELU2)
            return fused_moe(x, self.w13, self.w2, topk_weights, topk_ids, residual=residual, small_batch=small_batch,
                             w13_scale=self.w13_scale, w2_scale=self.w2_scale, block=self.block, **options)
        if isinstance(self.weight_method, Mxfp4MoeMethod):  # (the kernels' reference: not built on CPU)
            w13, w2 = self.weight_method.dequantized(self, x.dtype)
            out = experts_torch(x, w13, w2, topk_weights, topk_ids, w13_bias=self.w13_bias, w2_bias=self.w2_bias,
                                activation=act)
        elif self.w13_scale is None or self.w2_scale is None:
            out = experts_torch(x, self.w13, self.w2, topk_weights, topk_ids, w13_bias=self.w13_bias,
                                w2_bias=self.w2_bias, activation=act)
        else:
            out = experts_fp8_torch(x, self.w13, self.w13_scale, self.w2, self.w2_scale, topk_weights, topk_ids,
                                    self.block, activation=functools.partial(gated_activation_torch, activation=act))
        return out if residual is None else out + residual

    def expected_weights(self) -> set[tuple[int, str, str]]:
        """(expert, shard, leaf) triples a checkpoint must provide: gate (gated experts only), up and down of
        every expert, each its `weight` or the quantized method's tensors."""
        method = self.weight_method
        leaves = ("weight",) if method is None or method.float_weight else method.checkpoint_params
        shards = ("gate", "up", "down") if self.gated else ("up", "down")
        return {(e, shard, leaf) for e in range(self.num_experts) for shard in shards for leaf in leaves}

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
        if shard == "gate" and not self.gated:
            raise ValueError(f"expert {expert_id}: a gate projection, but these experts are not gated (up, down)")
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
            self.w13.data[local, inter if self.gated else 0:].copy_(value)
        else:
            self.w2.data[local].copy_(value)

    def load_stacked(self, param_name: str, tensor: Weight) -> None:
        """Every expert's tensor at once, as checkpoints that store them stacked (gpt-oss) hold them:
        "w13" [E, 2I, H] (gate rows, then up rows; non-gated experts: [E, I, H], the up rows), "w2" [E, H, I],
        "w13_bias" [E, 2I], "w2_bias" [E, H]; this rank's experts and intermediate rows / columns. w2's bias
        is added once: by rank 0 of a sharded layer (every rank's partial sum is all-reduced), by each
        expert's rank under expert parallelism."""
        param = getattr(self, param_name, None)
        if param_name not in ("w13", "w2", "w13_bias", "w2_bias") or param is None:
            raise ValueError(f"the experts have no stacked parameter {param_name!r}")
        full, inter, hidden = self.checkpoint_intermediate_size, self.intermediate_size, self.hidden_size
        rows = 2 * full if self.gated else full
        expected = {"w13": (self.num_experts, rows, hidden), "w2": (self.num_experts, hidden, full),
                    "w13_bias": (self.num_experts, 2 * full), "w2_bias": (self.num_experts, hidden)}[param_name]
        if tuple(tensor.shape) != expected:
            raise ValueError(f"experts' {param_name}: checkpoint shape {tuple(tensor.shape)}, model expects {expected}")
        # This rank's experts, still unread when the tensor is the checkpoint's: a rank reads only its experts'
        # rows and, sharded, its intermediate columns of them (a 26B-A4B layer's experts are ~1.5 GB whole).
        experts = row_block(tensor, self.expert_start, self.num_local_experts)
        if inter != full and param_name == "w13" and not self.gated:  # this rank's up rows
            value = narrow(experts, 1, self.inter_start, inter)
        elif inter != full and param_name in ("w13", "w13_bias"):  # this rank's gate rows and up rows
            value = torch.cat([narrow(experts, 1, self.inter_start, inter),
                               narrow(experts, 1, full + self.inter_start, inter)], dim=1)
        elif inter != full and param_name == "w2":
            value = narrow(experts, 2, self.inter_start, inter)
        elif inter != full and param_name == "w2_bias" and self.tp.rank != 0:
            param.data.zero_()
            return
        else:
            value = materialize(experts)
        param.data.copy_(value)

    def finalize_quantized(self) -> None:
        """After loading: an online method quantizes the float experts."""
        if self.weight_method is not None:
            self.weight_method.finalize(self)

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                residual: torch.Tensor | None = None, reduce: bool = True) -> torch.Tensor:
        """The routed experts' output summed over the ranks. residual: this rank's share of something added
        before that one all-reduce (a shared expert's partial product: experts_with_shared). reduce False: this
        rank's partial sum, for a caller that maps it linearly before its own all-reduce (Nemotron-H's
        fc2_latent_proj: models/nemotron_h_moe.py)."""
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
        out = self.run_experts(x, topk_weights, topk_ids, residual=residual)
        return self.tp.all_reduce(out) if reduce else out


def experts_with_shared(experts: FusedMoE, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                        shared_mlp: nn.Module, shared_x: torch.Tensor,
                        shared_gate: torch.Tensor | None = None) -> torch.Tensor:
    """Routed experts on x plus a shared-expert MLP (models/llama.py LlamaMLP) on shared_x, times shared_gate
    (a per-token factor, Qwen2-MoE's) when given. Under tensor parallelism both are sums of per-rank partial
    products: the shared expert's partial goes in as the routed experts' residual, so the layer all-reduces
    once instead of twice (DeepSeek, GLM-4.5, Llama 4 and Qwen2-MoE layers; vLLM sums them the same way).
    One rank, or a LoRA-wrapped shared down_proj (whose adapter adds after the all-reduce), keeps the
    plain sum."""
    if experts.tp.size > 1 and isinstance(shared_mlp.down_proj, RowParallelLinear):
        partial = shared_mlp(shared_x, reduce=False)
        if shared_gate is not None:
            partial = shared_gate * partial
        return experts(x, topk_weights, topk_ids, residual=partial)
    shared = shared_mlp(shared_x)
    if shared_gate is not None:
        shared = shared_gate * shared
    return experts(x, topk_weights, topk_ids) + shared
