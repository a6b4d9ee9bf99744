"""Mistral 3 (Mistral3ForConditionalGeneration: Mistral Small 3.1 and 3.2; Ministral 3 and Mistral-Medium-3.5,
whose text_config is a `ministral3`: models/ministral3.py; Mistral Small 4's `mistral4`: models/mistral4.py,
which builds DeepSeek's stack under the same tower): a Mistral language model, the Pixtral
vision tower (models/vision/pixtral_vision.py) and transformers' Mistral3MultiModalProjector:

    features = tower(image)[vision_feature_layer]            [rows * m, cols * m] patches, row-major
    x = norm(features)                                         RMSNorm, the text config's rms_norm_eps
    x = patch_merger(x)                                        each m x m square of patches (m =
                                                               spatial_merge_size) concatenated channel-major
                                                               ([C, m, m] per square, squares row-major)
                                                               -> merging_layer, a Linear without bias
    rows = linear_2(act(linear_1(x)))                          one per square: rows * cols of them

An image of a prompt is the layout `[IMG]` x cols then `[IMG_BREAK]`, per row, the last row ending in
`[IMG_END]` (multimodal/pixtral_processing.py); its item's run covers the whole layout and its
embed_positions are the `[IMG]` positions, which take the rows above in order; the breaks and the end keep
their token embeddings. The language model then runs as it always does (causal attention throughout).

Checkpoint names: the hub's layout (`language_model.model.*`, `language_model.lm_head.*`, `vision_tower.*`,
`multi_modal_projector.*`, which transformers 5 also saves) or transformers 5's module names
(`model.language_model.*`, `lm_head.*`, `model.vision_tower.*`, `model.multi_modal_projector.*`). Whether the
LM head is tied is the top-level config's tie_word_embeddings when it says (transformers 5 reads that one),
else the text config's. Tensor parallelism as LLaVA's. Quantized checkpoints (Ministral 3's FP8 releases:
quantization_config at the top level, modules_to_not_convert naming the tower, the projector and lm_head)
quantize the language model's projections only: the tower and projector are plain torch layers.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from ferrox.model_spec import ModelSpec, UnsupportedModelError
from ferrox.models.llama import MistralForCausalLM
from ferrox.models.llava import PROJECTOR_ACTIVATIONS, LlavaLayoutWeights
from ferrox.models.ministral3 import Ministral3Model
from ferrox.models.vision.encoder_setup import vision_device
from ferrox.models.vision.pixtral_vision import PixtralVisionTower, RMSNorm
from ferrox.multimodal.inputs import MultiModalItem


class Mistral3PatchMerger(nn.Module):
    def __init__(self, width: int, merge: int, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.merge = merge
        self.merging_layer = nn.Linear(width * merge * merge, width, bias=False, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
        """x [rows * m * cols * m, C] one image's patches, row-major -> [rows * cols, C] (torch's unfold order:
        each square's values channel-major)."""
        m = self.merge
        squares = x.view(rows, m, cols, m, -1).permute(0, 2, 4, 1, 3).reshape(rows * cols, -1)
        return self.merging_layer(squares)


class Mistral3Projector(nn.Module):
    def __init__(self, vision_hidden: int, text_hidden: int, merge: int, eps: float, act: str, bias: bool,
                 dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        if act not in PROJECTOR_ACTIVATIONS:
            raise UnsupportedModelError(f"config.json: projector_hidden_act {act!r} is not supported "
                                        f"(supported: {', '.join(PROJECTOR_ACTIVATIONS)})")
        self.norm = RMSNorm(vision_hidden, eps, dtype, device)
        self.patch_merger = Mistral3PatchMerger(vision_hidden, merge, dtype, device)
        self.linear_1 = nn.Linear(vision_hidden, text_hidden, bias=bias, dtype=dtype, device=device)
        self.linear_2 = nn.Linear(text_hidden, text_hidden, bias=bias, dtype=dtype, device=device)
        self.act = PROJECTOR_ACTIVATIONS[act]

    def forward(self, features: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
        x = self.patch_merger(self.norm(features), rows, cols)
        return self.linear_2(self.act(self.linear_1(x)))


def image_layout(rows: int, cols: int) -> tuple[int, list[int]]:
    """(run length, the `[IMG]` positions in it) of an image of rows x cols embeddings: each row is cols `[IMG]`
    and one `[IMG_BREAK]` (the last one `[IMG_END]`)."""
    return rows * (cols + 1), [r * (cols + 1) + c for r in range(rows) for c in range(cols)]


def check_pixtral_item(item: MultiModalItem, channels: int, unit: int) -> str | None:
    """What is wrong with a Pixtral image item (grid [rows, cols] of embeddings, pixels [C, rows * unit,
    cols * unit], the rows layout), or None."""
    if item.grid is None or len(item.grid) != 2 or min(item.grid) < 1:
        return "no (rows, cols) grid"
    rows, cols = item.grid
    length, where = image_layout(rows, cols)
    if item.length != length:
        return f"{item.length} placeholder tokens for a {rows}x{cols} grid (its layout takes {length})"
    if item.embed_positions != where:
        return f"embed_positions are not the [IMG] positions of a {rows}x{cols} layout"
    want = [channels, rows * unit, cols * unit]
    if list(item.shape) != want:
        return f"pixels {list(item.shape)}, the grid {item.grid} takes {want}"
    return None


class PixtralImages:
    """The Pixtral tower and Mistral 3's projector beside a language model: built by `build_pixtral` after the
    language model, then read by check_image_item / embed_image_item (Mistral3ForConditionalGeneration over a
    Mistral or Ministral 3 stack; models/mistral4.py's over Mistral 4's)."""

    vision_tower: PixtralVisionTower
    multi_modal_projector: nn.Module  # (a Mistral3Projector)
    merge: int
    _dtype: torch.dtype

    def build_pixtral(self, spec: ModelSpec, dtype: torch.dtype, device: torch.device | str) -> None:
        mm = spec.hf_config["multimodal"]
        vision = mm.get("vision_config") or {}
        if vision.get("model_type", "pixtral") != "pixtral":
            raise UnsupportedModelError(f"config.json: vision_config.model_type {vision['model_type']!r} of a "
                                        "Mistral 3 model is not supported (pixtral)")
        layer = mm.get("vision_feature_layer", -1)
        if not isinstance(layer, int) or isinstance(layer, bool):
            raise UnsupportedModelError(f"config.json: vision_feature_layer {layer!r}: only one layer (an integer) "
                                        "is supported, not a list of layers")
        self.vision_tower = PixtralVisionTower(vision, dtype=dtype, device=vision_device(device), feature_layer=layer)
        self.merge = int(mm.get("spatial_merge_size", 2))
        if self.merge < 1:
            raise UnsupportedModelError(f"config.json: spatial_merge_size {self.merge} must be positive")
        self.multi_modal_projector = Mistral3Projector(
            self.vision_tower.hidden_size, spec.hidden_size, self.merge, spec.rms_norm_eps,
            str(mm.get("projector_hidden_act", "gelu")), bool(mm.get("multimodal_projector_bias", False)), dtype,
            vision_device(device))
        self._dtype = dtype

    def check_image_item(self, item: MultiModalItem) -> str | None:
        """What is wrong with an image item for this model (worker/multimodal.py check_items), or None."""
        return check_pixtral_item(item, self.vision_tower.num_channels, self.vision_tower.patch_size * self.merge)

    def embed_image_item(self, item: MultiModalItem, device: torch.device) -> torch.Tensor:
        """[rows * cols, hidden]: the tower and projector over the image (one row per `[IMG]`)."""
        assert item.grid is not None  # check_image_item
        rows, cols = item.grid
        pixels = item.pixel_values().to(device=device, dtype=self._dtype)
        return self.multi_modal_projector(self.vision_tower([pixels]), rows, cols)


def tied_from_top_level(spec: ModelSpec) -> ModelSpec:
    """The spec with the top-level config's tie_word_embeddings when it says (transformers 5 reads that one)."""
    mm = spec.hf_config["multimodal"]
    if "tie_word_embeddings" in mm:
        return dataclasses.replace(spec, tie_word_embeddings=bool(mm["tie_word_embeddings"]))
    return spec


class Mistral3ForConditionalGeneration(PixtralImages, LlavaLayoutWeights, MistralForCausalLM):
    # Only the language model's Linear layers take a quantization method (module docstring).
    supports_quantization = True

    def __init__(self, spec: ModelSpec, dtype: torch.dtype, device: torch.device | str, *,
                 kernels: str | None = None):
        text_type = spec.hf_config.get("model_type")
        if text_type not in ("mistral", "ministral3"):
            # (A mistral4 text config is models/mistral4.py's class: models/registry.py TEXT_VARIANTS.)
            raise UnsupportedModelError(f"config.json: text_config.model_type {text_type!r} of a Mistral 3 model is "
                                        "not supported (mistral, ministral3, mistral4)")
        if text_type == "ministral3":
            self.model_class = Ministral3Model  # (read by the Llama constructor: the stack with Llama 4's query scaling)
        super().__init__(tied_from_top_level(spec), dtype, device, kernels=kernels)
        self.build_pixtral(spec, dtype, device)
