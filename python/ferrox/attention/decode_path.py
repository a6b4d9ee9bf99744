"""A model's decode path: the object, chosen with the attention backend when the model is built,
that may run a whole step itself and that computes the logits.

The model describes its decoder layers once (`OneTokenLayer`) and asks its backend for a path
(`AttentionBackend.decode_path`). Per step it asks `takes_step`; when the path takes it, the path
runs every decoder layer and returns the residual stream (the model applies its final norm).
`logits` is the lm_head of every step.

`DecodePath` here is the general path: it takes no step (every op runs through the model's
layers) and computes logits with one matmul. The Triton backend's path runs one-token steps in
fused matrix-vector kernels (attention/fused_decode.py). A quantized GGUF on the CPU gets, once its
weights are packed, a path that runs every step in the Rust kernels (attention/cpu_decode.py). FERROX_FUSED_DECODE=0 turns those off
(A/B benchmarks, bisecting); it is read per step, so it can be flipped on a built model.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from ferrox.attention.metadata import AttentionMetadata
from ferrox.kernels import dense_gemv_cuda


def fused_decode_enabled() -> bool:
    """FERROX_FUSED_DECODE=0 turns the one-token kernels off (for A/B benchmarks and bisecting)."""
    return os.environ.get("FERROX_FUSED_DECODE", "1") != "0"


class NormWeights(Protocol):
    @property
    def weight(self) -> torch.Tensor: ...

    @property
    def eps(self) -> float: ...


class ProjWeights(Protocol):
    @property
    def weight(self) -> torch.Tensor: ...  # [out, in]

    @property
    def bias(self) -> torch.Tensor | None: ...


@dataclass(frozen=True, slots=True)
class OneTokenMoe:
    """A mixture-of-experts MLP as the fused decode path reads it (models/moe.py MoeBlock):

        x = post_norm(h);  weights, ids = top_k(softmax(router(x)))
        h = h + sum_j weights_j * expert_{ids_j}(x)  [+ sigmoid(shared_gate(x)) * shared(x)]

    `block` is the MoeBlock module: `gate` (the fp32 router, E x H), `experts` (layers/fused_moe.py
    FusedMoE: w13, w2, its tensor-parallel share and all-reduce), `top_k`, `renormalize`, and
    the optional `shared_expert` / `shared_expert_gate`."""

    block: Any


@dataclass(frozen=True, slots=True)
class OneTokenLayer:
    """A pre-norm decoder layer as a fused decode path reads it:

        h = h + o_proj(attention(rotary(qkv_proj(input_norm(h)))))
        h = h + down_proj(silu(gate) * up),  [gate | up] = gate_up_proj(post_norm(h))

    qkv_proj's rows are [q | k | v] heads, gate_up_proj's [gate | up]. Qwen3 norms each q and k
    head (q_norm, k_norm) between the projection and rotary. A sparse layer has `moe` in place
    of gate_up_proj / down_proj (None). The fields are the modules themselves, not their
    tensors, so weights loaded after the model is built are the ones read."""

    input_norm: NormWeights
    qkv_proj: ProjWeights
    o_proj: ProjWeights
    post_norm: NormWeights
    gate_up_proj: ProjWeights | None
    down_proj: ProjWeights | None
    num_heads: int  # this rank's heads under tensor parallelism
    num_kv_heads: int
    head_dim: int
    scale: float
    # The tensor-parallel group (distributed/parallel_state.TPGroup) when o_proj and down_proj are
    # row-parallel: their partial products are summed by an all-reduce. None: one rank.
    tp: Any = None
    # The attention layer's KV-cache scales (attention/kv_cache.KVCacheScales; an FP8 cache reads
    # them). None: 1.0.
    kv_scales: Any = None
    q_norm: NormWeights | None = None
    k_norm: NormWeights | None = None
    moe: OneTokenMoe | None = None
    window: int = 0  # the layer's sliding window as served (0: full attention)
    rotary: bool = True  # False: a NoPE layer (SmolLM3), q and k attend unrotated
    chunk: int = 0  # the layer's attention chunk (Llama 4's chunked local attention; 0: none)


class DecodePath:
    """The general path: every step runs through the model's layers."""

    name = "general"

    def takes_step(self, num_tokens: int, kv_caches: Sequence[torch.Tensor],
                   meta: AttentionMetadata | None = None) -> bool:
        """Whether `forward` runs this step (asked before the first layer, once per forward)."""
        return False

    def forward(self, h: torch.Tensor, positions: torch.Tensor, kv_caches: Sequence[torch.Tensor],
                meta: AttentionMetadata) -> torch.Tensor:
        """The residual stream after the last decoder layer, from the embeddings h."""
        raise NotImplementedError(f"the {self.name} decode path takes no step itself")

    def logits(self, hidden: torch.Tensor, lm_head_weight: torch.Tensor) -> torch.Tensor:
        """float32 logits [rows, vocab] of hidden [rows, hidden_size] (a few rows on a GPU: the tensor-core
        product for few tokens, its sums stored as float32)."""
        if 2 <= hidden.shape[0] <= dense_gemv_cuda.MAX_TOKENS:  # (None off a GPU)
            logits = dense_gemv_cuda.few_token_product(hidden, lm_head_weight, out_dtype=torch.float32)
            if logits is not None:
                return logits
        return F.linear(hidden, lm_head_weight).float()
