"""The shape of a model (ModelSpec), shared downwards.

Kernels, layers, attention and models read a ModelSpec; the loader builds it
(loader/model_config.py). Keeping it here, below all of those, lets every import point one way:
model code never imports the loader, which imports the models. The errors about a model
(ModelLoadError, UnsupportedModelError) live in ferrox/errors.py with the rest of the tree and
are re-exported here for model code.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ferrox.config_fields import to_int
from ferrox.errors import ModelLoadError, UnsupportedModelError

__all__ = ["ModelLoadError", "ModelSpec", "MoeSpec", "UnsupportedModelError", "rope_type_of", "sliding_layer_kinds", "spec_for_context",
           "uses_long_rope"]

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
    # The attention window config.json declares (sliding_window W: a token sees itself and the W - 1
    # before it), when it is shorter than the context, and which layers use it (the rest attend
    # fully: Gemma alternates them); None: no window.
    sliding_window: int | None = None
    sliding_layers: tuple[bool, ...] | None = None
    # Each layer's window as the engine serves it (0: full attention), set with the served max_model_len
    # (spec_for_context): a window no shorter than the context changes nothing, so it stays 0 there and
    # every kernel keeps its unwindowed path. Empty: no windows.
    attention_windows: tuple[int, ...] = ()
    # Partial rotary (config.json partial_rotary_factor < 1, Phi-4-mini): how many dims of each head
    # rotate; None: all. Only families that reorder q/k rows at load take it (layers/rotary.py).
    rotary_dim: int | None = None
    # LongRoPE's long factors are in use (the served max_model_len exceeds the original context; set
    # by the engine before the model is built: layers/rotary.py uses_long_rope).
    rope_long_context: bool = False
    # The softmax scale of the attention scores when it is not head_dim ** -0.5 (Granite's
    # attention_multiplier); set by the family's model class, read by every attention path.
    attention_scale: float | None = None
    # Planes of the paged KV cache: 2 (K and V), or 1 where the value is read from the key row (DeepSeek's
    # latent attention: models/mla_attention.py), which halves the cache.
    kv_planes: int = 2
    # (KV heads, head_dim) of each layer's cache where layers differ (Gemma 4's global layers: wider heads,
    # fewer of them); empty: every layer (num_kv_heads, head_dim). attention/kv_cache.py allocates by it.
    layer_kv_shapes: tuple[tuple[int, int], ...] = ()
    extra: dict[str, Any] = field(default_factory=dict)

    def kv_shape_of(self, layer: int) -> tuple[int, int]:
        """(KV heads, head_dim) of layer `layer`'s cache (all of the model's KV heads, before any sharding)."""
        return self.layer_kv_shapes[layer] if self.layer_kv_shapes else (self.num_kv_heads, self.head_dim)

    def window_of(self, layer: int) -> int:
        """Layer `layer`'s attention window as served (0: full attention)."""
        return self.attention_windows[layer] if self.attention_windows else 0


def sliding_layer_kinds(config: dict[str, Any], num_layers: int, where: str) -> tuple[bool, ...]:
    """Which layers use the sliding window: config.json's layer_types (transformers >= 4.5x writes it),
    else each family's rule as transformers derives it -- Gemma 2 and gpt-oss every other layer from the first,
    Gemma 3, Cohere2 and EXAONE 4 all but every sliding_window_pattern-th (EXAONE's may also be letters, "LLLG"), OLMo 3
    all but every fourth, Qwen2 from max_window_layers on, every layer otherwise (Mistral, Phi-3)."""
    types = config.get("layer_types")
    if types is not None:
        if not isinstance(types, list) or len(types) != num_layers:
            raise ModelLoadError(f"{where}: field 'layer_types' must list one type per layer ({num_layers}), "
                                 f"got {types!r}")
        unknown = set(types) - {"sliding_attention", "full_attention"}
        if unknown:
            raise UnsupportedModelError(f"{where}: layer_types {sorted(unknown)} are not supported "
                                        "(sliding_attention, full_attention)")
        return tuple(t == "sliding_attention" for t in types)
    arch = str((config.get("architectures") or [""])[0])
    if arch in ("Gemma2ForCausalLM", "GptOssForCausalLM"):
        return tuple(i % 2 == 0 for i in range(num_layers))
    if arch in ("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration"):
        pattern = to_int(config.get("sliding_window_pattern", 6), f"{where}: field 'sliding_window_pattern'")
        return tuple((i + 1) % pattern != 0 for i in range(num_layers))
    if arch == "Olmo3ForCausalLM":
        return tuple((i + 1) % 4 != 0 for i in range(num_layers))
    if arch == "Cohere2ForCausalLM":
        pattern = to_int(config.get("sliding_window_pattern", 4), f"{where}: field 'sliding_window_pattern'")
        return tuple((i + 1) % pattern != 0 for i in range(num_layers))
    if arch == "Exaone4ForCausalLM":
        # sliding_window_pattern: N (every N-th layer full) or letters ("LLLG": L local, G global), repeated.
        pattern = config.get("sliding_window_pattern", 4)
        if isinstance(pattern, str) and pattern and set(pattern) <= {"L", "G"}:
            return tuple(pattern[i % len(pattern)] == "L" for i in range(num_layers))
        pattern = to_int(pattern, f"{where}: field 'sliding_window_pattern'", minimum=1)
        return tuple((i + 1) % pattern != 0 for i in range(num_layers))
    if arch in ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM"):
        first = to_int(config.get("max_window_layers", num_layers), f"{where}: field 'max_window_layers'",
                       minimum=0)
        return tuple(i >= first for i in range(num_layers))
    return (True,) * num_layers


def hybrid_layer_types(config: dict[str, Any]) -> list[str] | None:
    """A hybrid model's layer kinds, None for any other model: "full_attention" for an attention layer (the only kind
    with a KV cache), else the token mixer with recurrent states -- "linear_attention" (Gated DeltaNet: Qwen3.5,
    Qwen3-Next) or "mamba" (Mamba2: Granite 4.0-H, Nemotron-H) -- or, in Nemotron-H, "mlp" / "moe" (a layer that
    is only an MLP). Qwen: config.json's layer_types, else (Qwen3-Next's older
    configs) every full_attention_interval-th layer full attention, transformers' rule. Granite 4.0-H: layer_types
    ("mamba" / "attention", or transformers 5's "linear_attention" / "full_attention"; all Mamba2 when absent)."""
    types = config.get("layer_types")
    model_type = config.get("model_type")
    if model_type not in HYBRID_MODEL_TYPES:
        return None
    num_layers = int(config["num_hidden_layers"])
    if model_type == "nemotron_h":
        return _nemotron_h_layer_types(config, num_layers)
    if model_type in MAMBA2_MODEL_TYPES:
        types = types if types is not None else config.get("layers_block_type", ["mamba"] * num_layers)
        kinds = {"mamba": "mamba", "linear_attention": "mamba", "attention": "full_attention",
                 "full_attention": "full_attention"}
        if not isinstance(types, list) or len(types) != num_layers or any(t not in kinds for t in types):
            raise ModelLoadError(f"config.json: layer_types must list 'mamba' or 'attention' for each of the "
                                 f"{num_layers} layers, got {types!r}")
        return [kinds[t] for t in types]
    if types is None:
        interval = int(config.get("full_attention_interval") or 4)
        types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(num_layers)]
    if not isinstance(types, list) or len(types) != num_layers or any(
            t not in ("linear_attention", "full_attention") for t in types):
        raise ModelLoadError(f"config.json: layer_types must list 'linear_attention' or 'full_attention' for each "
                             f"of the {num_layers} layers, got {types!r}")
    return list(types)


def _nemotron_h_layer_types(config: dict[str, Any], num_layers: int) -> list[str]:
    """Nemotron-H's layers: hybrid_override_pattern (M Mamba2, * attention, - MLP, E MoE: the releases' configs) or
    transformers 5's layers_block_type, as "mamba" / "full_attention" / "mlp" / "moe"."""
    letters = {"M": "mamba", "*": "full_attention", "-": "mlp", "E": "moe"}
    names = {"linear_attention": "mamba", "mamba": "mamba", "full_attention": "full_attention",
             "attention": "full_attention", "mlp": "mlp", "moe": "moe"}
    pattern = config.get("hybrid_override_pattern")
    if isinstance(pattern, str):
        if len(pattern) != num_layers or set(pattern) - set(letters):
            raise ModelLoadError(f"config.json: hybrid_override_pattern {pattern!r} must hold one of M, *, -, E for "
                                 f"each of the {num_layers} layers")
        return [letters[c] for c in pattern]
    types = config.get("layers_block_type", config.get("layer_types"))
    if not isinstance(types, list) or len(types) != num_layers or any(t not in names for t in types):
        raise ModelLoadError(f"config.json: Nemotron-H needs hybrid_override_pattern (or layers_block_type) for each "
                             f"of the {num_layers} layers, got {types!r}")
    return [names[t] for t in types]


# The text model_types of hybrid models: Gated DeltaNet / attention (models/qwen3_5.py) and Mamba2 / attention
# (models/granitemoehybrid.py, models/nemotron_h.py).
MAMBA2_MODEL_TYPES = ("granitemoehybrid", "nemotron_h")
HYBRID_MODEL_TYPES = ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text", *MAMBA2_MODEL_TYPES)


def rope_type_of(scaling: dict[str, Any] | None) -> str:
    """A rope scaling's rope_type ("type" in older configs; "su" is LongRoPE's first name)."""
    kind = str((scaling or {}).get("rope_type", (scaling or {}).get("type", "default")))
    return "longrope" if kind == "su" else kind


def uses_long_rope(scaling: dict[str, Any] | None, max_model_len: int) -> bool:
    """LongRoPE's choice of factors, made once for the engine as vLLM makes it: the long factors when
    the served context exceeds original_max_position_embeddings. (transformers switches per forward
    on the sequence's current length, which would leave a request's cached keys rotated by the short
    factors once it grows past that length; for requests that stay on one side the two agree.)"""
    if rope_type_of(scaling) != "longrope":
        return False
    return max_model_len > int(scaling["original_max_position_embeddings"])  # type: ignore[index]


def spec_for_context(spec: ModelSpec, max_model_len: int) -> ModelSpec:
    """The spec a model serving max_model_len tokens is built from: LongRoPE's factors and the
    layers' attention windows depend on it."""
    long_context = uses_long_rope(spec.rope_scaling, max_model_len)
    windows: tuple[int, ...] = ()
    if spec.sliding_window is not None and spec.sliding_layers and max_model_len > spec.sliding_window:
        windows = tuple(spec.sliding_window if sliding else 0 for sliding in spec.sliding_layers)
    if long_context == spec.rope_long_context and windows == spec.attention_windows:
        return spec
    return dataclasses.replace(spec, rope_long_context=long_context, attention_windows=windows)
