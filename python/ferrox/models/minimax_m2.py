"""MiniMax-M2, M2.1 and M2.5 (MiniMaxM2ForCausalLM) on the shared MoE stack (models/moe.py).

What differs from Mixtral, whose checkpoint names it shares (block_sparse_moe.experts.{e}.w1/w3/w2), as
transformers' MiniMaxM2 defines it:

- routing (`MiniMaxM2Block.route`): sigmoid scores of the float32 router; the top k of scores +
  `e_score_correction_bias` (block_sparse_moe.e_score_correction_bias, beside the router) name the experts,
  which are weighted by their unbiased scores renormalised to sum to 1 (always: no norm_topk_prob), no scaling.
  That is DeepSeek-V3's noaux_tc with one group (layers/grouped_topk.py). The fused one-token decode path
  routes with softmax top-k, so these models decode through the general path; the experts still run in the
  fused Triton MoE kernels on GPU. No shared expert, every layer sparse;
- q/k norm "per_layer" (`qk_norm_type`): ONE RMSNorm over the whole q projection (num_heads * head_dim, a
  weight per row) and one over the whole k projection, before the split into heads -- not Qwen3's per-head
  norm. Under tensor parallelism a rank holds only its heads' rows, so the mean of squares is all-reduced
  (`ProjectionRMSNorm`; one all-reduce a layer for q and k together);
- rotary over the first `rotary_dim` dims of each head (64 of 128 in the released configs, which name no
  partial_rotary_factor), in the half-split layout: q/k rows, and the q/k norm weights with them, reordered at
  load into whole-head pairs as for GLM-4.5 (layers/rotary.py partial_rotary_order). The whole-projection norm
  does not see the order of its rows, as long as its weight is permuted alike.

The checkpoints carry `num_mtp_modules` multi-token-prediction layers after the last decoder layer
(model.layers.{num_hidden_layers}...); the base model does not run them, and they are skipped at load as vLLM
skips them. Tensor and expert parallelism are the MoE stack's (plus the norms' all-reduce). The published FP8
checkpoints (block-wise, 128-row blocks of 128-dim heads) load as stored: a reordered q/k row stays in its
block row. Refused by name: another checkpoint quantization_config (the q/k rows are permuted at load),
`scoring_func` other than sigmoid, `qk_norm_type` other than per_layer or use_qk_norm false (transformers always
norms), linear-attention layers (`attn_type_list` 0: MiniMax-Text-01's lightning attention), a shared expert
(`shared_intermediate_size`). LoRA adapts the attention, the adapters' q/k rows permuted as the weights'
(`lora_rewrite`), and the routed experts (lora/moe_targets.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from ferrox.attention.backend import AttentionBackend
from ferrox.distributed.parallel_state import TPGroup, get_tp_group
from ferrox.distributed.sharding import even_split, kv_head_range, narrow, shape_of
from ferrox.layers.grouped_topk import grouped_topk
from ferrox.layers.layernorm import RMSNorm
from ferrox.layers.ops import DeviceOps, Rope
from ferrox.layers.rotary import partial_rotary_order
from ferrox.model_spec import ModelLoadError, ModelSpec, MoeSpec, UnsupportedModelError
from ferrox.models.glm4 import (
    check_checkpoint_quantization,
    reorder_rotary_rows,
    without_mtp_layers,
)
from ferrox.models.llama import LlamaAttention
from ferrox.models.moe import MoeBlock, MoeForCausalLM, MoeModel

_ARCH = "MiniMaxM2ForCausalLM"
# transformers' MiniMaxM2Config default rope_theta (config.json names it in every release).
_DEFAULT_ROPE_THETA = 5_000_000.0


class ProjectionRMSNorm(RMSNorm):
    """RMSNorm over a whole projection of `total_heads` heads (a weight per row). A tensor-parallel rank holds
    the rows of heads [first_head, first_head + heads); its mean of squares is averaged over the ranks, each of
    which holds as many rows (KV heads replicated over ranks count once per rank, so the average is the same).
    The arithmetic is transformers': normalise in float32, cast back, times the weight."""

    def __init__(self, total_heads: int, first_head: int, heads: int, head_dim: int, eps: float,
                 dtype: torch.dtype, device: torch.device | str | None, ops: DeviceOps):
        super().__init__(heads * head_dim, eps, dtype, device, ops)
        self.first_row, self.total_rows = first_head * head_dim, total_heads * head_dim
        self.tp: TPGroup = get_tp_group()

    @staticmethod
    def mean_square(x: torch.Tensor) -> torch.Tensor:
        """[T, 1] float32: this rank's part of the statistic."""
        return x.float().square().mean(-1, keepdim=True)

    def normalize(self, x: torch.Tensor, mean_square: torch.Tensor) -> torch.Tensor:
        """x over every rank's mean of squares (mean_square, already averaged over the ranks)."""
        return (x.float() * torch.rsqrt(mean_square + self.eps)).to(x.dtype) * self.weight

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        if residual is not None:
            raise ValueError("ProjectionRMSNorm has no fused residual add")
        return self.normalize(x, average_over_ranks(self.tp, self.mean_square(x)))

    def load_weight(self, leaf: str, tensor: Any, shard: str | None = None) -> None:
        """The checkpoint's whole [total_rows] weight; this rank keeps its heads' rows."""
        if leaf != "weight" or shape_of(tensor) != (self.total_rows,):
            raise ValueError(f"checkpoint {leaf} of shape {shape_of(tensor)}, the model expects weight of "
                             f"({self.total_rows},)")
        self.weight.data.copy_(narrow(tensor, 0, self.first_row, self.size))


def average_over_ranks(tp: TPGroup, x: torch.Tensor) -> torch.Tensor:
    return tp.all_reduce(x) / tp.size if tp.size > 1 else x


class MiniMaxM2Attention(LlamaAttention):
    """Llama's attention with MiniMax's whole-projection q/k norms before the rotary."""

    q_norm: ProjectionRMSNorm
    k_norm: ProjectionRMSNorm

    def __init__(self, spec: ModelSpec, backend: AttentionBackend, ops: DeviceOps, dtype, device, *,
                 qkv_bias: bool, o_bias: bool, qk_norm: bool, window: int = 0):
        super().__init__(spec, backend, ops, dtype, device, qkv_bias=qkv_bias, o_bias=o_bias, qk_norm=False,
                         window=window)
        tp = get_tp_group()
        q_start, _ = even_split(spec.num_heads, tp.size, tp.rank, "num_attention_heads")
        kv_start, _ = kv_head_range(spec.num_kv_heads, tp.size, tp.rank)
        self.q_norm = ProjectionRMSNorm(spec.num_heads, q_start, self.num_heads, spec.head_dim, spec.rms_norm_eps,
                                        dtype, device, ops)
        self.k_norm = ProjectionRMSNorm(spec.num_kv_heads, kv_start, self.num_kv_heads, spec.head_dim,
                                        spec.rms_norm_eps, dtype, device, ops)

    def forward(self, x, rope: Rope, kv_cache, meta):
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = qkv[:, :q_size], qkv[:, q_size:q_size + kv_size], qkv[:, q_size + kv_size:]
        # Both norms' statistics in one tensor: one all-reduce a layer under tensor parallelism.
        stats = average_over_ranks(self.q_norm.tp, torch.cat([self.q_norm.mean_square(q),
                                                              self.k_norm.mean_square(k)], dim=1))
        q = self.q_norm.normalize(q, stats[:, :1]).view(t, self.num_heads, self.head_dim)
        k = self.k_norm.normalize(k, stats[:, 1:]).view(t, self.num_kv_heads, self.head_dim)
        q, k = rope.rotate(q, k)  # (new tensors: the Triton rotary may turn them in place)
        o = self.backend.forward(q, k, v.view(t, self.num_kv_heads, self.head_dim), kv_cache, meta, self.scale,
                                 self.kv_scales, window=self.window)
        return self.o_proj(o.reshape(t, q_size))


class MiniMaxM2Block(MoeBlock):
    """Sigmoid top-k steered by the correction bias, weights the renormalised unbiased scores."""

    fused_decode_routing = False  # (the fused one-token path routes with softmax)

    def __init__(self, spec: ModelSpec, moe: MoeSpec, ops: DeviceOps, dtype, device, *, renormalize: bool):
        super().__init__(spec, moe, ops, dtype, device, renormalize=renormalize)
        # float32, as the released checkpoints store it (vLLM keeps it so too); use_routing_bias false: none.
        self.e_score_correction_bias: nn.Parameter | None = None
        if spec.hf_config.get("use_routing_bias", True):
            self.e_score_correction_bias = nn.Parameter(
                torch.zeros(moe.num_experts, dtype=torch.float32, device=device), requires_grad=False)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return grouped_topk(self.gate(x), self.top_k, scoring_func="sigmoid", renormalize=self.renormalize,
                            e_score_correction_bias=self.e_score_correction_bias)


class MiniMaxM2Model(MoeModel):
    block_class = MiniMaxM2Block
    attention_class = MiniMaxM2Attention


def _check_config(config: dict[str, Any]) -> None:
    """UnsupportedModelError naming a config.json field this family does not run as transformers does."""
    where = "config.json"
    if config.get("scoring_func", "sigmoid") != "sigmoid":
        raise UnsupportedModelError(f"{where}: scoring_func {config['scoring_func']!r} is not supported for {_ARCH} "
                                    "(its router scores with sigmoid)")
    if config.get("qk_norm_type", "per_layer") != "per_layer" or config.get("use_qk_norm", True) is False:
        raise UnsupportedModelError(
            f"{where}: use_qk_norm {config.get('use_qk_norm')!r} / qk_norm_type {config.get('qk_norm_type')!r} "
            f"is not supported for {_ARCH} (only the per_layer q/k norm over the whole projection)")
    if 0 in (config.get("attn_type_list") or []):
        raise UnsupportedModelError(f"{where}: attn_type_list has linear-attention layers (0), which {_ARCH} does "
                                    "not run (MiniMax-Text-01's lightning attention is not supported)")
    if config.get("shared_intermediate_size"):
        raise UnsupportedModelError(f"{where}: shared_intermediate_size {config['shared_intermediate_size']!r}: a "
                                    f"shared expert is not supported for {_ARCH}")
    if config.get("attention_bias"):
        raise UnsupportedModelError(f"{where}: attention_bias is not supported for {_ARCH} (no q/k/v bias)")


def minimax_m2_spec(spec: ModelSpec) -> ModelSpec:
    """The spec the MoE stack reads: the rotary width from config.json's `rotary_dim` when it names no
    partial_rotary_factor (the released configs; transformers converts it the same way), and transformers'
    default rope_theta."""
    config = spec.hf_config
    rope = config.get("rope_parameters") if isinstance(config.get("rope_parameters"), dict) else {}
    changes: dict[str, Any] = {}
    factor_named = "partial_rotary_factor" in (rope or {}) or config.get("partial_rotary_factor") is not None
    rotary_dim = config.get("rotary_dim")
    if not factor_named and rotary_dim is not None:
        if isinstance(rotary_dim, bool) or not isinstance(rotary_dim, int) or not (
                2 <= rotary_dim <= spec.head_dim and rotary_dim % 2 == 0):
            raise ModelLoadError(f"config.json: field 'rotary_dim' must be an even integer within 2..head_dim "
                                 f"({spec.head_dim}), got {rotary_dim!r}")
        changes["rotary_dim"] = None if rotary_dim == spec.head_dim else rotary_dim
    if config.get("rope_theta") is None and (rope or {}).get("rope_theta") is None:
        changes["rope_theta"] = _DEFAULT_ROPE_THETA
    return dataclasses.replace(spec, **changes) if changes else spec


class MiniMaxM2ForCausalLM(MoeForCausalLM):
    model_class = MiniMaxM2Model
    always_renormalize = True  # (transformers renormalises the top-k weights unconditionally)
    reorders_partial_rotary = True

    def __init__(self, spec: ModelSpec, dtype: torch.dtype, device: torch.device | str, *,
                 kernels: str | None = None):
        _check_config(spec.hf_config)
        spec = minimax_m2_spec(spec)
        order = None if spec.rotary_dim is None else partial_rotary_order(spec.head_dim, spec.rotary_dim)
        check_checkpoint_quantization(spec, order, block_fp8=True)  # (the published FP8 checkpoints: block-wise)
        super().__init__(spec, dtype, device, kernels=kernels)
        self.rotary_order = order
        mtp = spec.hf_config.get("num_mtp_modules") or 0
        if isinstance(mtp, bool) or not isinstance(mtp, int) or mtp < 0:
            raise ModelLoadError(f"config.json: field 'num_mtp_modules' must be an integer >= 0, got {mtp!r}")
        self.num_mtp_layers = mtp

    def _rows_rewritten(self, weights: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
        return reorder_rotary_rows(without_mtp_layers(weights, self.spec.num_layers, self.num_mtp_layers),
                                   self.spec.head_dim, self.rotary_order)

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        super().load_weights(self._rows_rewritten(weights))

    def lora_rewrite(self, pairs: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
        """Adapters' (module.weight, lora_B) pairs with the checkpoint's row edits (lora/rewrite.py): the MTP
        layers' dropped (the model runs no LoRA there), q/k rows permuted (row-only)."""
        return self._rows_rewritten(pairs)
