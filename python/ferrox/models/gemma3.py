"""Gemma 3 text (Gemma3ForCausalLM: gemma-3-1b, gemma-3-270m and their -it): Gemma 2's decoder
(models/gemma2.py: four (1 + w) norms a layer, GELU-tanh MLP, sqrt(hidden) embedding scale,
query_pre_attn_scalar) with three changes, as transformers' Gemma3 defines them:

- q and k are RMS-normed per head before rotary ((1 + w) norms too, folded with the rest);
- local (sliding-window) layers and global layers rotate with different RoPE: the local base frequency
  (rope_local_base_freq, 10,000) unscaled, the global rope_theta (1,000,000) with the config's
  rope_scaling (linear 8 on the 4B+ checkpoints); transformers >= 5 writes both under rope_parameters,
  keyed by layer type;
- no soft caps (attn_logit_softcapping and final_logit_softcapping are null), and five local layers
  for every global one (layer_types, or sliding_window_pattern 6), with a 512- or 1,024-token window.

The multimodal checkpoints (Gemma3ForConditionalGeneration: 4B/12B/27B with vision) are another
architecture and are refused by the registry; bidirectional attention (EmbeddingGemma) is refused here.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

from ferrox.layers.ops import DeviceOps, Rope
from ferrox.layers.rotary import RotaryEmbedding
from ferrox.model_spec import ModelSpec, UnsupportedModelError
from ferrox.models.gemma2 import Gemma2ForCausalLM, Gemma2Model


def rope_settings(config: dict[str, Any]) -> tuple[tuple[float, dict | None], tuple[float, dict | None]]:
    """((local theta, local scaling), (global theta, global scaling)) from either config format."""
    nested = config.get("rope_parameters")
    if isinstance(nested, dict) and ("sliding_attention" in nested or "full_attention" in nested):
        def part(key: str, theta: float) -> tuple[float, dict | None]:
            params = dict(nested.get(key) or {})
            theta = float(params.pop("rope_theta", theta))
            kind = params.get("rope_type", params.get("type", "default"))
            return theta, (params if kind != "default" else None)

        return part("sliding_attention", 10_000.0), part("full_attention", 1_000_000.0)
    scaling = config.get("rope_scaling")
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    local = float(config.get("rope_local_base_freq", 10_000.0))
    return (local, None), (float(config.get("rope_theta", 1_000_000.0)), scaling if kind != "default" else None)


class Gemma3Model(Gemma2Model):
    gemma_qk_norm = True

    def make_rotary(self, spec: ModelSpec, device: torch.device | str, ops: DeviceOps) -> RotaryEmbedding:
        """The global layers' rotary (returned, as `rotary`); the local layers' is kept beside it."""
        (local_theta, local_scaling), (global_theta, global_scaling) = rope_settings(spec.hf_config)
        self.rotary_local = RotaryEmbedding(spec.head_dim, local_theta, local_scaling, device, ops)
        # Which layers rotate with the local RoPE: the windowed kind, whatever window is served.
        self.local = tuple(spec.sliding_layers or (False,) * spec.num_layers)
        return RotaryEmbedding(spec.head_dim, global_theta, global_scaling, device, ops,
                               max_position_embeddings=spec.max_position_embeddings,
                               long_context=spec.rope_long_context)

    def layer_ropes(self, positions: torch.Tensor, dtype: torch.dtype) -> list[Rope]:
        rope_global = self.rotary(positions, dtype)
        rope_local = self.rotary_local(positions, dtype) if any(self.local) else rope_global
        return [rope_local if local else rope_global for local in self.local]


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    model_class = Gemma3Model

    def __init__(self, spec: ModelSpec, dtype: torch.dtype, device: torch.device | str, *,
                 kernels: str | None = None):
        if spec.hf_config.get("use_bidirectional_attention"):
            raise UnsupportedModelError("config.json: use_bidirectional_attention (EmbeddingGemma) is not supported "
                                        "for Gemma3ForCausalLM: ferrox's attention is causal")
        super().__init__(spec, dtype, device, kernels=kernels)


# The multimodal checkpoint's tensors: its language model under one of two prefixes (transformers < 4.52
# and since), the vision tower and projector, which a text-only engine does not load.
_LANGUAGE_PREFIXES = ("model.language_model.", "language_model.model.")
_VISION_PREFIXES = ("model.vision_tower.", "vision_tower.", "model.multi_modal_projector.", "multi_modal_projector.")


class Gemma3ForConditionalGeneration(Gemma3ForCausalLM):
    """gemma-3-4b/12b/27b-it served text-only: the language model of the multimodal checkpoint (config.json's
    text_config over Gemma3TextConfig's defaults: loader/model_config.py); its vision tower is not loaded,
    and requests with images are refused by name as on every ferrox model (a text-only engine)."""

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        def language_model() -> Iterator[tuple[str, Any]]:
            for name, tensor in weights:
                if name.startswith(_VISION_PREFIXES):
                    continue
                prefix = next((p for p in _LANGUAGE_PREFIXES if name.startswith(p)), None)
                if prefix is not None:
                    yield "model." + name[len(prefix):], tensor
                elif name in ("lm_head.weight", "language_model.lm_head.weight"):
                    continue  # tied to the embedding (some exports store the copy)
                else:
                    yield name, tensor

        super().load_weights(language_model())
