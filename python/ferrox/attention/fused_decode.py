"""The Triton backend's decode path: a step of exactly one token in fused matrix-vector kernels.

Batch-1 decode (and a one-token prefill) is weight reads plus launch overhead, so each decoder
layer runs in five launches (kernels/gemv.py): norm + qkv + rotary + KV write, attention over the
cache, o_proj + residual, norm + gate_up + SiLU, down_proj + residual; the residual stream h is a
complete vector between them (no pending "x + residual"). A one-row lm_head is one launch that
writes float32 logits (cuBLAS + a cast are two, plus split-K). Larger batches keep the general
path: cuBLAS GEMMs reuse each weight tile across rows.

The layers come from the model (`OneTokenLayer`); a model whose layers do not fit the fused
kernels passes none and still gets the one-row lm_head. FP8 and int8 projections
(layers/quant/fp8.py, compressed_tensors_int8.py) run the same kernels: their weight is float8 or
int8 and their `weight_scale` rows go to the kernel's epilogue (W8A8 ones in w8a8_dot_gemv.py and
the qkv kernel's quantizing variant). Block-wise FP8 projections (fp8_block.py) run w8a8_dot_gemv.py
with their block scales (each K tile a group of the input, quantized on its own); their qkv
projection, like int4's below, leaves rotary and the KV write to a second launch. int4 projections (AWQ / GPTQ: layers/quant/int4_pack.py, whose runner `Linear.quant`
holds the packed weight) run the int4 GEMV (kernels/int4_matmul.py; on a GPU with tensor cores, the
CUDA kernel of int4_gemv_cuda.py it routes to) with the same prologue and epilogues: the input norm,
the bias, SiLU(gate) * up, the residual. It has no rotary epilogue (a
program would need both halves of its rotary pairs, two row sets as gemv.py's qkv kernel streams),
so their qkv GEMV writes the projected row and a second launch rotates q and k and writes the KV
cache (`qk_norm_rope_cache` without norms): six launches a layer. Act-order int4 layers keep the
general path (int4_pack.py says why).

Qwen3's per-head q/k norms need a whole head's projection before rotary, so those layers run the
qkv projection as a plain GEMV and the norms, rotary and KV write in a second launch
(`qk_norm_rope_cache`). A mixture-of-experts layer (`OneTokenMoe`) replaces the MLP's two
launches by four: the router GEMV (fp32 logits) with the post-attention norm in its prologue,
the softmax top-k (+ renormalisation) in one launch, the small-batch gate/up kernel over the k
chosen experts with the same norm in its prologue (kernels/fused_moe.py `fused_moe_from_logits`),
and the down kernel, which adds the residual in its epilogue. FP8 experts (layers/quant/fp8_moe.py)
quantize their normed input in a launch of their own, so they take the explicit sequence below
(six launches a layer). A shared expert (Qwen2-MoE) or a tensor-parallel share needs the normed vector itself:
those layers keep the explicit sequence (rms_norm, router GEMV, `route_top_k`, experts) with the
shared expert's or the experts' own forward, with its all-reduce. (The models pass these layers
on one rank only until the path has run under tensor parallelism on two GPUs.)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from ferrox.attention.decode_path import (
    DecodePath,
    NormWeights,
    OneTokenLayer,
    OneTokenMoe,
    ProjWeights,
    fused_decode_enabled,
)
from ferrox.attention.metadata import AttentionMetadata
from ferrox.kernels.fused_moe import fused_moe_from_logits, route_top_k
from ferrox.kernels.gemv import gemv, qkv_rope_gemv
from ferrox.kernels.int4_matmul import Int4Weights, int4_gemv
from ferrox.kernels.qk_norm_rope import qk_norm_rope_cache
from ferrox.kernels.rmsnorm import rms_norm
from ferrox.kernels.w8a8_dot_gemv import w8a8_dot_gemv

if TYPE_CHECKING:
    from ferrox.attention.backend import AttentionBackend


class FusedOneTokenDecode(DecodePath):
    name = "fused-one-token"

    def __init__(self, backend: AttentionBackend, layers: Sequence[OneTokenLayer] | None,
                 rope_rows: Callable[[torch.Tensor], torch.Tensor],
                 q_scale: Callable[[torch.Tensor], torch.Tensor] | None = None):
        """backend: attends over KV the qkv kernel already wrote (`attend`). layers: the model's
        decoder layers in order, or None when they cannot take the fused path. rope_rows:
        positions [T] -> float32 [T, head_dim] = [cos | sin] (RotaryEmbedding.rope_rows). q_scale:
        positions [T] -> float32 [T] factors of the rotated queries (Ministral 3; None: 1), applied
        between the qkv kernel and attention (one elementwise launch a layer)."""
        if not backend.supports_cached_kv:
            raise ValueError(f"the {backend.name} attention backend cannot attend over KV written by the qkv kernel")
        self.backend = backend
        self.layers = tuple(layers) if layers is not None else None
        self.rope_rows = rope_rows
        self.q_scale = q_scale
        self.has_nope_layers = self.layers is not None and not all(layer.rotary for layer in self.layers)

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
        identity = rope_row
        if self.has_nope_layers:
            # NoPE layers (OneTokenLayer.rotary False) take the identity rotation, cos 1 and sin 0: the
            # kernels' float32 rotary then returns q and k exactly as projected.
            half = rope_row.shape[0] // 2
            identity = torch.cat((torch.ones_like(rope_row[:half]), torch.zeros_like(rope_row[half:])))
        q_scale = self.q_scale(positions) if self.q_scale is not None else None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            h = self._layer(layer, h, rope_row if layer.rotary else identity, kv_cache, meta, q_scale)
        return h

    def _layer(self, layer: OneTokenLayer, h: torch.Tensor, rope_row: torch.Tensor, kv_cache: torch.Tensor,
               meta: AttentionMetadata, q_scale: torch.Tensor | None = None) -> torch.Tensor:
        """One decoder layer in five launches (a dense Llama layer; six on int4 weights, whose qkv
        GEMV leaves rotary and the KV write to a second launch; one more with q_scale, float32 [1]:
        the rotated queries' factor); h [1, hidden] is the complete residual stream, in and out."""
        kv_scale = layer.kv_scales.scales if layer.kv_scales is not None else None
        qkv_proj = layer.qkv_proj
        if layer.q_norm is None and _int4_weights(qkv_proj) is None and _fp8_blocks(qkv_proj) is None:
            w8a8, input_scale = _w8a8_activations(qkv_proj)
            q = qkv_rope_gemv(h, qkv_proj.weight, qkv_proj.bias, norm_weight=layer.input_norm.weight,
                              eps=layer.input_norm.eps, rope_row=rope_row, slot_mapping=meta.slot_mapping,
                              kv_cache=kv_cache, num_q_heads=layer.num_heads, num_kv_heads=layer.num_kv_heads,
                              head_dim=layer.head_dim, weight_scale=_weight_scale(qkv_proj), kv_scale=kv_scale,
                              w8a8=w8a8, input_scale=input_scale)
        else:
            qkv = _project(h, qkv_proj, qkv_proj.bias, norm=layer.input_norm)
            q_norm, k_norm = layer.q_norm, layer.k_norm  # Qwen3's per-head norms (None: rotary only)
            q = qk_norm_rope_cache(qkv, q_norm_weight=q_norm.weight if q_norm is not None else None,
                                   k_norm_weight=k_norm.weight if k_norm is not None else None,
                                   eps=q_norm.eps if q_norm is not None else 0.0, rope_row=rope_row,
                                   slot_mapping=meta.slot_mapping, kv_cache=kv_cache, num_q_heads=layer.num_heads,
                                   num_kv_heads=layer.num_kv_heads, head_dim=layer.head_dim, kv_scale=kv_scale)
        if q_scale is not None:
            q = (q * q_scale[:, None, None]).to(q.dtype)
        o = self.backend.attend(q, kv_cache, meta, layer.scale, layer.kv_scales, window=layer.window,
                                chunk=layer.chunk)
        h = self._row_parallel(layer, o.view(1, -1), layer.o_proj, h)
        if layer.moe is not None:
            return self._moe(layer, layer.moe, h)
        assert layer.gate_up_proj is not None and layer.down_proj is not None  # a dense layer
        act = _project(h, layer.gate_up_proj, layer.gate_up_proj.bias, norm=layer.post_norm, silu_mul=True)
        return self._row_parallel(layer, act, layer.down_proj, h)

    @staticmethod
    def _moe(layer: OneTokenLayer, moe: OneTokenMoe, h: torch.Tensor, *, fuse_routing: bool = True) -> torch.Tensor:
        """h + the sparse MLP of post_norm(h), reading only the chosen experts. On one rank without
        a shared expert: 4 launches, the norm in the GEMVs' prologues; fuse_routing=False
        (and the other layers) run the explicit sequence, 5 launches on one rank."""
        block = moe.block
        norm = layer.post_norm
        experts = block.experts
        plain = block.shared_expert is None and experts.tp.size == 1
        # FP8 experts quantize their input in a launch of its own, so the norm cannot ride in the
        # GEMV prologue: they take the explicit sequence.
        if plain and fuse_routing and experts.w13_scale is None:
            logits = gemv(h, block.gate.weight, norm_weight=norm.weight, eps=norm.eps, out_dtype=torch.float32)
            out, _, _ = fused_moe_from_logits(h, logits, experts.w13, experts.w2, top_k=block.top_k,
                                              renormalize=block.renormalize, norm_weight=norm.weight,
                                              eps=norm.eps, residual=h)
            return out
        x = rms_norm(h, norm.weight, norm.eps)
        logits = gemv(x, block.gate.weight, out_dtype=torch.float32)
        weights, ids = route_top_k(logits, block.top_k, block.renormalize)
        if plain:
            return experts.run_experts(x, weights, ids, residual=h, small_batch=True)
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
        if tp is None or tp.size == 1:
            return _project(x, proj, proj.bias, residual=h)
        if tp.rank == 0:
            return tp.all_reduce(_project(x, proj, proj.bias, residual=h))
        return tp.all_reduce(_project(x, proj, None))

    def logits(self, hidden: torch.Tensor, lm_head_weight: torch.Tensor) -> torch.Tensor:
        if hidden.shape[0] == 1 and fused_decode_enabled():
            return gemv(hidden.contiguous(), lm_head_weight, out_dtype=torch.float32)
        return super().logits(hidden, lm_head_weight)


def _project(x: torch.Tensor, proj: ProjWeights, bias: torch.Tensor | None, *, norm: NormWeights | None = None,
             silu_mul: bool = False, residual: torch.Tensor | None = None) -> torch.Tensor:
    """proj(norm(x)) + bias [-> silu(gate) * up] [+ residual] for one token, in the kernel of the
    projection's weight: int4 (kernels/int4_matmul.py), fp8 or int8 with quantized activations
    (tensor cores, kernels/w8a8_dot_gemv.py), float or weight-only fp8 / int8 (kernels/gemv.py)."""
    norm_weight, eps = (norm.weight, norm.eps) if norm is not None else (None, 0.0)
    packed = _int4_weights(proj)
    if packed is not None:  # (validated once, by the runner; the layer's shapes are fixed)
        return int4_gemv(x, packed, bias, validate=False, norm_weight=norm_weight, eps=eps, silu_mul=silu_mul,
                         residual=residual)
    blocks = _fp8_blocks(proj)
    if blocks is not None:
        return w8a8_dot_gemv(x, proj.weight, blocks[0], bias, norm_weight=norm_weight, eps=eps, silu_mul=silu_mul,
                             residual=residual, block=blocks[1])
    w8a8, input_scale = _w8a8_activations(proj)
    weight_scale = _weight_scale(proj)
    if w8a8 and weight_scale is not None:
        return w8a8_dot_gemv(x, proj.weight, weight_scale, bias, norm_weight=norm_weight, eps=eps,
                             silu_mul=silu_mul, residual=residual, input_scale=input_scale)
    return gemv(x, proj.weight, bias, norm_weight=norm_weight, eps=eps, silu_mul=silu_mul, residual=residual,
                weight_scale=weight_scale)


def _weight_scale(proj: ProjWeights) -> torch.Tensor | None:
    """The per-row float32 scales of an fp8 or int8 projection (layers/quant/fp8.py), None for a float
    one."""
    return getattr(proj, "weight_scale", None)


def _w8a8_activations(proj: ProjWeights) -> tuple[bool, torch.Tensor | None]:
    """(whether an fp8 / int8 projection quantizes its one-token input too, its static input scale or None);
    (False, None) for every other weight. (Duck-typed, as `_int4_weights`.)"""
    w8a8 = getattr(getattr(proj, "quant", None), "one_token_w8a8", None)
    return w8a8() if w8a8 is not None else (False, None)


def _fp8_blocks(proj: ProjWeights) -> tuple[torch.Tensor, tuple[int, int]] | None:
    """(block scales, (BN, BK)) of a block-wise FP8 projection (layers/quant/fp8_block.py), None for
    every other weight. (Duck-typed, as `_int4_weights`.)"""
    blocks = getattr(getattr(proj, "quant", None), "one_token_blocks", None)
    return blocks() if blocks is not None else None


def _int4_weights(proj: ProjWeights) -> Int4Weights | None:
    """The packed weight of an int4 projection (its runner, `Linear.quant`, is an
    layers/quant/int4_pack.Int4Linear, which says whether the fused kernels can read it), None for a
    float or fp8 one. (Duck-typed: attention sits beside layers, not above them.)"""
    fused_weights = getattr(getattr(proj, "quant", None), "fused_decode_weights", None)
    return fused_weights() if fused_weights is not None else None
