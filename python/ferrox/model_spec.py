"""The shape of a model (ModelSpec), shared downwards.

Kernels, layers, attention and models read a ModelSpec; the loader builds it
(loader/model_config.py). Keeping it here, below all of those, lets every import point one way:
model code never imports the loader, which imports the models. The errors about a model
(ModelLoadError, UnsupportedModelError) live in ferrox/errors.py with the rest of the tree and
are re-exported here for model code.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ferrox.errors import ModelLoadError, UnsupportedModelError

__all__ = ["ModelLoadError", "ModelSpec", "MoeSpec", "UnsupportedModelError"]

if TYPE_CHECKING:  # torch stays unimported: loader.source and loader.errors must load without it
    import torch


@dataclass(frozen=True, slots=True)
class MoeSpec:
    """The mixture-of-experts part of a config (Qwen2-MoE, Qwen3-MoE, Mixtral).

    A decoder layer is sparse unless listed in mlp_only_layers, and only every
    decoder_sparse_step-th layer is (Qwen); dense layers use ModelSpec.intermediate_size.
    Whether top-k weights are renormalised is each family's rule: norm_topk_prob is what the
    config says (Mixtral has no such field and always renormalises)."""

    num_experts: int
    num_experts_per_tok: int
    intermediate_size: int  # of one expert
    norm_topk_prob: bool = False
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE: one always-on expert, 0 = none
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()

    def is_sparse(self, layer: int) -> bool:
        return layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0


@dataclass(slots=True)
class ModelSpec:
    hf_config: dict[str, Any]
    architecture: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    dtype: torch.dtype  # what the checkpoint stores (used for dtype="auto" on GPU)
    tie_word_embeddings: bool
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    attention_bias: bool = False
    mlp_bias: bool = False
    hidden_act: str = "silu"
    moe: MoeSpec | None = None  # set for mixture-of-experts configs
    # The attention window config.json declares (sliding_window), when it bounds the context:
    # ferrox has no sliding-window attention, so max_position_embeddings is already capped to it
    # (within the window full attention is the same thing) and max_model_len errors name it.
    sliding_window: int | None = None
    # Partial rotary (config.json partial_rotary_factor < 1, Phi-4-mini): how many dims of each head
    # rotate; None: all. Only families that reorder q/k rows at load take it (layers/rotary.py).
    rotary_dim: int | None = None
    # LongRoPE's long factors are in use (the served max_model_len exceeds the original context; set
    # by the engine before the model is built: layers/rotary.py uses_long_rope).
    rope_long_context: bool = False
    # The softmax scale of the attention scores when it is not head_dim ** -0.5 (Granite's
    # attention_multiplier); set by the family's model class, read by every attention path.
    attention_scale: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)
