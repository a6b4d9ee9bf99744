"""Cohere Command R7B / Command A (CohereLabs/c4ai-command-r7b-12-2024, command-a-03-2025: Cohere2ForCausalLM), as
transformers' Cohere2 defines it: Cohere's parallel LayerNorm block, interleaved rotary rows reordered at load and
logit_scale (models/cohere.py), with sliding-window layers (`layer_types`, else all but every
`sliding_window_pattern`-th, default 4) that rotate q and k, and full-attention layers that take no rotary at all.
The rotary choice follows the layer kinds from the config, not the served windows (a window no shorter than the
context changes the mask only). Refused by name: `sliding_window` null (transformers' layers would then rotate
nowhere), `use_qk_norm` (Cohere2 has none), and what Cohere refuses.
"""

from __future__ import annotations

import torch

from ferrox.model_spec import ModelSpec, UnsupportedModelError, sliding_layer_kinds
from ferrox.models.cohere import CohereForCausalLM, CohereModel


class Cohere2Model(CohereModel):
    def layer_rotaries(self, spec: ModelSpec) -> tuple[bool, ...]:
        return sliding_layer_kinds(spec.hf_config, spec.num_layers, "config.json")


class Cohere2ForCausalLM(CohereForCausalLM):
    model_class = Cohere2Model

    def __init__(self, spec: ModelSpec, dtype: torch.dtype, device: torch.device | str, *,
                 kernels: str | None = None):
        config = spec.hf_config
        if not config.get("sliding_window"):
            raise UnsupportedModelError("config.json: sliding_window null is not supported for Cohere2ForCausalLM "
                                        "(transformers' Cohere2 layers then take no rotary anywhere)")
        if config.get("use_qk_norm"):
            raise UnsupportedModelError("config.json: use_qk_norm is not supported for Cohere2ForCausalLM")
        super().__init__(spec, dtype, device, kernels=kernels)


__all__ = ["Cohere2ForCausalLM"]
