"""Qwen3-VL, dense (Qwen3VLForConditionalGeneration): a Qwen3 language model (q/k norms) rotating by
multimodal positions in the interleaved layout (layers/rotary.py MRotaryEmbedding; the positions are
Qwen2-VL's for images: worker/mrope.py), and a vision transformer over each image's patch grid
(models/vision/qwen3_vl_vision.py) whose merger gives one row per 2x2 patches. The prompt side is
Qwen2-VL's with 16-pixel patches (multimodal/qwen2_vl_processing.py reads them from the folder).

DeepStack: the tower also merges the hidden states of a few of its blocks (vision_config.
deepstack_visual_indexes), one set of rows per block, and the language model adds set i to its hidden states
at the image's tokens after decoder layer i. The path, for an image step only (those run eagerly):

    embed_image_item(item)  -> [tokens, (1 + D) * hidden]: the input rows, then the D DeepStack sets side by
                               side, so the runner's row slicing and caching (worker/multimodal.py) cut all
                               of them alike when a chunked prefill splits the image
    StepImages.deepstack    -> [D, k, hidden] of the step's k image rows (split off by `deepstack_layers`)
    forward(deepstack=(rows, embeds)) -> Qwen3VLTextModel's layer loop adds embeds[i] at `rows` after layer i

Text-only steps (and every step without image rows) call the plain Llama stack unchanged. The image side
(Qwen3VLImages) is shared with Qwen3-VL-MoE (models/qwen3_vl_moe.py), whose stack is moe.py's.

Checkpoint names: `model.language_model.*`, `model.visual.*`, `lm_head.weight` (the hub's and transformers 5's
files); `model.*` / `visual.*` load as well. tie_word_embeddings: the top-level config's, which is what
transformers 5 ties by, else text_config's. Unquantized (under tensor parallelism the tower loads whole, its
blocks then sharded under --mm-encoder-tp-mode weights: models/vision/encoder_setup.py).

Videos go through the same tower (grid t > 1, attention within each frame) and DeepStack. A video's item runs
over its whole expansion, each frame's `<t seconds>` text included (multimodal/qwen2_vl_processing.py), and
embed_positions marks the pads that take the tower's rows, as vLLM selects them; worker/mrope.py reads each
frame's pads as a one-frame image.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

import torch

from ferrox.errors import UnsupportedModelError
from ferrox.model_spec import ModelSpec
from ferrox.models.llama import LlamaModel
from ferrox.models.qwen import Qwen3ForCausalLM
from ferrox.models.qwen2_vl import Qwen2VLForConditionalGeneration, load_with_visual
from ferrox.models.vision.encoder_setup import vision_device
from ferrox.multimodal.inputs import MultiModalItem


def deepstack_layers(model: Any, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                     meta: Any, inputs_embeds: torch.Tensor | None,
                     deepstack: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
    """A decoder stack's general layer loop (`layers`, `rotary`, `norm`: LlamaModel's and MoeModel's alike) with
    DeepStack's set i added at the image rows after layer i; an image step only (no fused decode path)."""
    h = model.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
    rope = model.rotary(positions, h.dtype)
    residual = None
    for i, layer in enumerate(model.layers):
        h, residual = layer(h, residual, rope, kv_caches[i], meta)
        if deepstack is not None and i < deepstack[1].shape[0]:
            rows, embeds = deepstack  # [k] step rows, [D, k, hidden]
            # The layer's output is h + residual (the next norm adds them): adding to h adds to the sum.
            h = h.index_add(0, rows, embeds[i].to(h.dtype))
    h, _ = model.norm(h, residual)
    return h


class Qwen3VLTextModel(LlamaModel):
    """The Qwen3 decoder stack with DeepStack's additions after its first layers."""

    def forward(self, input_ids, positions, kv_caches, meta, inputs_embeds=None,
                deepstack: tuple[torch.Tensor, torch.Tensor] | None = None):
        if deepstack is None:
            return super().forward(input_ids, positions, kv_caches, meta, inputs_embeds=inputs_embeds)
        return deepstack_layers(self, input_ids, positions, kv_caches, meta, inputs_embeds, deepstack)


class Qwen3VLImages:
    """Qwen3-VL's image side on a Qwen3 causal LM (dense here, mixture-of-experts in qwen3_vl_moe.py): the tower,
    the image hooks worker/multimodal.py calls, the image-step forward with DeepStack, the checkpoint's names.
    Listed before the language model's class, whose forward and load_weights it wraps."""

    model: Any
    backend: Any
    supports_tensor_parallel = True  # the tower loads whole (its blocks sharded after: encoder_setup.py)
    supports_quantized_gguf = False
    supports_quantization = False
    own_weight_prefixes: tuple[str, ...] = ("visual.",)
    takes_images = True

    @staticmethod
    def language_spec(spec: ModelSpec) -> ModelSpec:
        """The language model's spec: the rotary always interleaved, the top-level tie_word_embeddings."""
        mm = spec.hf_config["multimodal"]
        if spec.hf_config.get("mrope_interleaved", True) is not True:
            raise UnsupportedModelError("config.json: text_config.rope_parameters.mrope_interleaved "
                                        f"{spec.hf_config['mrope_interleaved']!r}: Qwen3-VL's multimodal rotary is "
                                        "interleaved (transformers applies it so whatever the flag says)",
                                        param="text_config.rope_parameters.mrope_interleaved")
        # transformers' Qwen3VLTextRotaryEmbedding interleaves always, the flag or not.
        spec = dataclasses.replace(spec, hf_config={**spec.hf_config, "mrope_interleaved": True})
        if mm.get("tie_word_embeddings") is not None:
            spec = dataclasses.replace(spec, tie_word_embeddings=bool(mm["tie_word_embeddings"]))
        return spec

    def init_images(self, spec: ModelSpec, dtype: torch.dtype, device: torch.device | str) -> None:
        """The vision tower and the hooks' settings, after the language model is built."""
        from ferrox.models.vision.qwen3_vl_vision import Qwen3VisionTower

        self.visual = Qwen3VisionTower(spec.hf_config["multimodal"].get("vision_config") or {}, dtype=dtype,
                                       device=vision_device(device))
        if self.visual.out_hidden_size != spec.hidden_size:
            raise UnsupportedModelError(f"config.json: vision_config.out_hidden_size {self.visual.out_hidden_size} "
                                        f"differs from the language model's hidden_size {spec.hidden_size}",
                                        param="vision_config.out_hidden_size")
        if len(self.visual.deepstack_indexes) > spec.num_layers:
            raise UnsupportedModelError(f"config.json: {len(self.visual.deepstack_indexes)} DeepStack layers for a "
                                        f"{spec.num_layers}-layer language model",
                                        param="vision_config.deepstack_visual_indexes")
        # worker/mrope.py: requests with images rotate by positions that merge this many patches a side.
        self.mrope_merge_size = int(self.visual.spatial_merge_size)
        self.patch_values = self.visual.patch_dim
        # worker/multimodal.py: the image rows carry this many DeepStack sets after the input rows.
        self.deepstack_layers = len(self.visual.deepstack_indexes)
        self._dtype = dtype

    takes_videos = True

    def check_image_item(self, item: MultiModalItem) -> str | None:
        """Qwen2-VL's (t, h, w) grid and pixel rules on the item's pads; a video's pads one run per frame."""
        where = item.embed_positions
        if where is None:
            return Qwen2VLForConditionalGeneration.check_image_item(self, item)  # type: ignore[arg-type]
        if item.modality != "video":
            return "only a video's run holds tokens other than its pads (its frames' timestamps)"
        pads = MultiModalItem(item.offset, len(where), item.pixels, item.shape, item.hash, item.modality, item.grid)
        problem = Qwen2VLForConditionalGeneration.check_image_item(self, pads)  # type: ignore[arg-type]
        if problem:
            return problem
        t, h, w = item.grid or (0, 0, 0)
        frame = h * w // self.mrope_merge_size**2
        if any(where[f * frame + frame - 1] - where[f * frame] != frame - 1 for f in range(t)):
            return "each frame's pads must be one run (embed_positions)"
        return None

    def embed_image_item(self, item: MultiModalItem, device: torch.device) -> torch.Tensor:
        """[item.length, (1 + D) * hidden]: the merger's rows, then each DeepStack merger's, side by side."""
        assert item.grid is not None  # check_image_item
        pixels = item.pixel_values().to(device=device, dtype=self._dtype)
        grid = torch.tensor([item.grid], dtype=torch.int64, device=device)
        rows, deepstack = self.visual(pixels, grid)
        return torch.cat([rows, *deepstack], dim=-1)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                attn_metadata: Any, inputs_embeds: torch.Tensor | None = None,
                deepstack: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """inputs_embeds and deepstack (the step's image rows [k], their DeepStack rows [D, k, hidden]): on image
        steps. Every other step is the language model's own."""
        if inputs_embeds is None:
            return super().forward(input_ids, positions, kv_caches, attn_metadata)  # type: ignore[misc]
        if len(kv_caches) != len(self.model.layers):
            raise ValueError(f"kv_caches has {len(kv_caches)} tensors, the model has {len(self.model.layers)} layers")
        self.backend.begin_forward(attn_metadata)
        return self.model(input_ids, positions, kv_caches, attn_metadata, inputs_embeds=inputs_embeds,
                          deepstack=deepstack)

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        load_with_visual(weights, super().load_weights, self.visual)  # type: ignore[misc]


class Qwen3VLForConditionalGeneration(Qwen3VLImages, Qwen3ForCausalLM):
    model_class = Qwen3VLTextModel

    def __init__(self, spec: ModelSpec, dtype: torch.dtype, device: torch.device | str, *,
                 kernels: str | None = None):
        super().__init__(self.language_spec(spec), dtype, device, kernels=kernels)
        self.init_images(spec, dtype, device)
