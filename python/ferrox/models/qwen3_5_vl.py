"""Qwen3.5 / Qwen3.6 with images and videos (Qwen3_5ForConditionalGeneration, Qwen3_5MoeForConditionalGeneration):
the hybrid Gated DeltaNet / gated-attention language models of models/qwen3_5.py (dense, or routed experts with a
shared expert) under Qwen3-VL's image side (models/qwen3_vl.py Qwen3VLImages) without DeepStack.

- The vision tower is Qwen3-VL's (transformers' Qwen3_5VisionModel: learned position table resampled to the
  grid, 2D rotary, one merger; models/vision/qwen3_vl_vision.py) with no DeepStack mergers: whatever
  vision_config says of deepstack_visual_indexes, transformers builds none, and neither does ferrox.
- The text rotary is Qwen3-VL's interleaved multimodal RoPE over the partial rotary of models/qwen3_5.py
  (partial_rotary_factor 0.25 on the releases: mrope_section [11, 11, 10] shares out the 32 rotated pairs of a
  256-dim head; layers/rotary.py MRotaryEmbedding's rotary_dim). Its positions are Qwen3-VL's
  (transformers' Qwen3_5Model.get_rope_index is Qwen3VLModel's line for line: a video one block per frame, after
  its timestamp text): worker/mrope.py.
- The prompt side is Qwen3-VL's (Qwen3VLProcessor: multimodal/qwen2_vl_processing.py QWEN3_ARCHITECTURES).

Image steps give the language model its input embeddings with the tower's rows at the image pads
(worker/model_forward.py); the hybrid stack runs them as any prompt step (its recurrent states carried across a
chunked prefill that cuts an image as across any other). Text-only steps are the language model's own.

Checkpoint names: `model.visual.*` to the tower, `model.language_model.*` (read as `model.*`), `lm_head.weight`,
`mtp.*` skipped (qwen3_5.py). --language-model-only: the tower is never built (models/vision/encoder_setup.py).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ferrox.layers.quant.method import use_quant_config
from ferrox.model_spec import ModelSpec
from ferrox.models.qwen3_5 import Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM
from ferrox.models.qwen3_vl import Qwen3VLImages


def _without_deepstack(spec: ModelSpec) -> ModelSpec:
    """The spec with vision_config.deepstack_visual_indexes emptied (module docstring)."""
    mm = spec.hf_config["multimodal"]
    vision = {**(mm.get("vision_config") or {}), "deepstack_visual_indexes": []}
    return dataclasses.replace(spec, hf_config={**spec.hf_config, "multimodal": {**mm, "vision_config": vision}})


class Qwen3_5Images(Qwen3VLImages):
    """Qwen3VLImages on a hybrid Qwen3.5 language model: the tower without DeepStack, image steps through the
    language model's own forward (inputs_embeds). Listed before the language model's class."""

    def __init__(self, spec: ModelSpec, dtype: torch.dtype, device: torch.device | str, *,
                 kernels: str | None = None):
        """The language model (the class after this one), then the tower."""
        super().__init__(self.language_spec(spec), dtype, device, kernels=kernels)  # type: ignore[call-arg]
        self.init_images(spec, dtype, device)

    def init_images(self, spec: ModelSpec, dtype: torch.dtype, device: torch.device | str) -> None:
        with use_quant_config(None):  # (the FP8 releases keep the tower in bf16)
            super().init_images(_without_deepstack(spec), dtype, device)
        assert self.deepstack_layers == 0

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                attn_metadata: Any, inputs_embeds: torch.Tensor | None = None,
                deepstack: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """The language model's forward (Qwen3VLImages' adds DeepStack, which this tower has none of: the runner
        passes no `deepstack`, deepstack_layers being 0)."""
        if deepstack is not None:
            raise ValueError("Qwen3.5's vision tower has no DeepStack rows to add")
        return super(Qwen3VLImages, self).forward(  # type: ignore[misc]
            input_ids, positions, kv_caches, attn_metadata, inputs_embeds=inputs_embeds)

    def _expected_keys(self) -> set[str]:
        """The language model's tensors (the tower checks its own: load_with_visual hands them over whole)."""
        keys: set[str] = super()._expected_keys()  # type: ignore[misc]
        return {key for key in keys if not key.startswith(self.own_weight_prefixes)}


class Qwen3_5ForConditionalGeneration(Qwen3_5Images, Qwen3_5ForCausalLM):
    # The tower loads whole (its blocks sharded after: encoder_setup.py): tensor parallel where the text is.
    supports_tensor_parallel = Qwen3_5ForCausalLM.supports_tensor_parallel
    supports_quantization = Qwen3_5ForCausalLM.supports_quantization


class Qwen3_5MoeForConditionalGeneration(Qwen3_5Images, Qwen3_5MoeForCausalLM):
    supports_tensor_parallel = Qwen3_5MoeForCausalLM.supports_tensor_parallel
    supports_quantization = Qwen3_5MoeForCausalLM.supports_quantization
