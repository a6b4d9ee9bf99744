"""The Triton backend's decode path: a step of exactly one token in fused matrix-vector kernels.

Batch-1 decode (and a one-token prefill) is weight reads plus launch overhead, so each decoder
layer runs in five launches (kernels/gemv.py): norm + qkv + rotary + KV write, attention over the
cache, o_proj + residual, norm + gate_up + SiLU, down_proj + residual; the residual stream h is a
complete vector between them (no pending "x + residual"). A one-row lm_head is one launch that
writes float32 logits (cuBLAS + a cast are two, plus split-K). Larger batches keep the general
path: cuBLAS GEMMs reuse each weight tile across rows.

The layers come from the model (`OneTokenLayer`); a model whose layers do not fit the fused
kernels passes none and still gets the one-row lm_head. FP8 projections (layers/quant/fp8.py)
run the same kernels: their weight is float8 and their `weight_scale` rows go to the kernel's
epilogue.

Qwen3's per-head q/k norms need a whole head's projection before rotary, so those layers run the
qkv projection as a plain GEMV and the norms, rotary and KV write in a second launch
(`qk_norm_rope_cache`). A mixture-of-experts layer (`OneTokenMoe`) replaces the MLP's two
launches by: the post-attention norm, the router GEMV (fp32 logits), the softmax top-k in one
launch (torch's select_experts is ~6), and the small-batch expert kernels, which read only the k
chosen experts and add the residual in the down kernel's epilogue. A shared expert (Qwen2-MoE)
runs its layer's own forward beside them. (The models pass these layers on one rank only until
the path has run under tensor parallelism on two GPUs; `_moe` already keeps the experts' own
forward, with its all-reduce, there.)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from ferrox.attention.decode_path import (
    DecodePath,
    OneTokenLayer,
    OneTokenMoe,
    ProjWeights,
    fused_decode_enabled,
)
from ferrox.attention.metadata import AttentionMetadata
from ferrox.kernels.fused_moe import fused_moe, route_top_k
from ferrox.kernels.gemv import gemv, qkv_rope_gemv
from ferrox.kernels.qk_norm_rope import qk_norm_rope_cache
from ferrox.kernels.rmsnorm import rms_norm

if TYPE_CHECKING:
    from ferrox.attention.backend import AttentionBackend


class FusedOneTokenDecode(DecodePath):
    name = "fused-one-token"

    def __init__(self, backend: AttentionBackend, layers: Sequence[OneTokenLayer] | None,
                 rope_rows: Callable[[torch.Tensor], torch.Tensor]):
        """backend: attends over KV the qkv kernel already wrote (`attend`). layers: the model's
        decoder layers in order, or None when they cannot take the fused path. rope_rows:
        positions [T] -> float32 [T, head_dim] = [cos | sin] (RotaryEmbedding.rope_rows)."""
        if not backend.supports_cached_kv:
            raise ValueError(f"the {backend.name} attention backend cannot attend over KV written by the qkv kernel")
        self.backend = backend
        self.layers = tuple(layers) if layers is not None else None
        self.rope_rows = rope_rows

    def takes_step(self, num_tokens: int, kv_caches: Sequence[torch.Tensor],
                   meta: AttentionMetadata | None = None) -> bool:
        # An empty KV cache (the profiling forward) has nowhere for the qkv kernel to write.
        return (self.layers is not None and num_tokens == 1 and bool(kv_caches) and kv_caches[0].numel() > 0
                and fused_decode_enabled())

    def forward(self, h: torch.Tensor, positions: torch.Tensor, kv_caches: Sequence[torch.Tensor],
                meta: AttentionMetadata) -> torch.Tensor:
        if self.layers is None:
            raise NotImplementedError("this model's layers do not take the fused one-token path")
        rope_row = self.rope_rows(positions)[0]
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            h = self._layer(layer, h, rope_row, kv_cache, meta)
        return h

    def _layer(self, layer: OneTokenLayer, h: torch.Tensor, rope_row: torch.Tensor, kv_cache: torch.Tensor,
               meta: AttentionMetadata) -> torch.Tensor:
        """One decoder layer in five launches (a dense Llama layer); h [1, hidden] is the complete
        residual stream, in and out."""
        kv_scale = layer.kv_scales.scales if layer.kv_scales is not None else None
        if layer.q_norm is None or layer.k_norm is None:
            q = qkv_rope_gemv(h, layer.qkv_proj.weight, layer.qkv_proj.bias, norm_weight=layer.input_norm.weight,
                              eps=layer.input_norm.eps, rope_row=rope_row, slot_mapping=meta.slot_mapping,
                              kv_cache=kv_cache, num_q_heads=layer.num_heads, num_kv_heads=layer.num_kv_heads,
                              head_dim=layer.head_dim, weight_scale=_weight_scale(layer.qkv_proj),
                              kv_scale=kv_scale)
        else:
            qkv = gemv(h, layer.qkv_proj.weight, layer.qkv_proj.bias, norm_weight=layer.input_norm.weight,
                       eps=layer.input_norm.eps, weight_scale=_weight_scale(layer.qkv_proj))
            q = qk_norm_rope_cache(qkv, q_norm_weight=layer.q_norm.weight, k_norm_weight=layer.k_norm.weight,
                                   eps=layer.q_norm.eps, rope_row=rope_row, slot_mapping=meta.slot_mapping,
                                   kv_cache=kv_cache, num_q_heads=layer.num_heads,
                                   num_kv_heads=layer.num_kv_heads, head_dim=layer.head_dim, kv_scale=kv_scale)
        o = self.backend.attend(q, kv_cache, meta, layer.scale, layer.kv_scales)
        h = self._row_parallel(layer, o.view(1, -1), layer.o_proj, h)
        if layer.moe is not None:
            return self._moe(layer, layer.moe, h)
        assert layer.gate_up_proj is not None and layer.down_proj is not None  # a dense layer
        act = gemv(h, layer.gate_up_proj.weight, layer.gate_up_proj.bias, norm_weight=layer.post_norm.weight,
                   eps=layer.post_norm.eps, silu_mul=True, weight_scale=_weight_scale(layer.gate_up_proj))
        return self._row_parallel(layer, act, layer.down_proj, h)

    @staticmethod
    def _moe(layer: OneTokenLayer, moe: OneTokenMoe, h: torch.Tensor) -> torch.Tensor:
        """h + the sparse MLP of post_norm(h), reading only the chosen experts."""
        block = moe.block
        x = rms_norm(h, layer.post_norm.weight, layer.post_norm.eps)
        logits = gemv(x, block.gate.weight, out_dtype=torch.float32)
        weights, ids = route_top_k(logits, block.top_k, block.renormalize)
        experts = block.experts
        if block.shared_expert is None and experts.tp.size == 1:
            return fused_moe(x, experts.w13, experts.w2, weights, ids, small_batch=True, residual=h)
        out = experts(x, weights, ids)  # a tensor-parallel share: the layer's own all-reduce
        if block.shared_expert is not None:
            out = out + torch.sigmoid(block.shared_expert_gate(x)) * block.shared_expert(x)
        return h + out

    @staticmethod
    def _row_parallel(layer: OneTokenLayer, x: torch.Tensor, proj: ProjWeights, h: torch.Tensor) -> torch.Tensor:
        """h + proj(x). Under tensor parallelism each rank's gemv gives a partial product; rank 0
        also adds the bias and the residual in its epilogue, so one all-reduce yields the sum with
        each added once, and the fusion survives sharding."""
        tp = layer.tp
        scale = _weight_scale(proj)
        if tp is None or tp.size == 1:
            return gemv(x, proj.weight, proj.bias, residual=h, weight_scale=scale)
        if tp.rank == 0:
            return tp.all_reduce(gemv(x, proj.weight, proj.bias, residual=h, weight_scale=scale))
        return tp.all_reduce(gemv(x, proj.weight, None, weight_scale=scale))

    def logits(self, hidden: torch.Tensor, lm_head_weight: torch.Tensor) -> torch.Tensor:
        if hidden.shape[0] == 1 and fused_decode_enabled():
            return gemv(hidden.contiguous(), lm_head_weight, out_dtype=torch.float32)
        return super().logits(hidden, lm_head_weight)


def _weight_scale(proj: ProjWeights) -> torch.Tensor | None:
    """The per-row float32 scales of an fp8 projection (layers/quant/fp8.py), None for a float one."""
    return getattr(proj, "weight_scale", None)
