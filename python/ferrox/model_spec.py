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

__all__ = ["ModelLoadError", "ModelSpec", "UnsupportedModelError"]

if TYPE_CHECKING:  # torch stays unimported: loader.source and loader.errors must load without it
    import torch


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
    extra: dict[str, Any] = field(default_factory=dict)
