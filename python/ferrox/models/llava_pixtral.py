"""LLaVA over a Pixtral tower (LlavaForConditionalGeneration whose vision_config.model_type is "pixtral":
Pixtral-12B as mistral-community/pixtral-12b publishes it): a Mistral language model, the Pixtral vision tower
(models/vision/pixtral_vision.py) and LLaVA's two-layer projector, as transformers' Llava runs it:

    features = tower(image)[vision_feature_layer]            [rows, cols] patches, row-major, every one kept
                                                               (the "full" feature strategy)
    rows = linear_2(act(linear_1(features)))                  one per patch

The image layout in the prompt is Pixtral's (multimodal/pixtral_processing.py with no patch merging): `[IMG]` x
cols then `[IMG_BREAK]` per row, the last row ending in `[IMG_END]`; only the `[IMG]` positions take rows.
models/registry.py picks this class for a LLaVA config with a Pixtral tower. Weight names: LLaVA's two layouts
(models/llava.py). Unquantized; tensor parallelism as LLaVA's.
"""

from __future__ import annotations

import torch

from ferrox.model_spec import ModelSpec, UnsupportedModelError
from ferrox.models.llama import MistralForCausalLM
from ferrox.models.llava import LlavaLayoutWeights, LlavaProjector
from ferrox.models.mistral3 import check_pixtral_item
from ferrox.models.vision.encoder_setup import vision_device
from ferrox.models.vision.pixtral_vision import PixtralVisionTower
from ferrox.multimodal.inputs import MultiModalItem


class LlavaPixtralForConditionalGeneration(LlavaLayoutWeights, MistralForCausalLM):

    def __init__(self, spec: ModelSpec, dtype: torch.dtype, device: torch.device | str, *,
                 kernels: str | None = None):
        mm = spec.hf_config["multimodal"]
        if spec.hf_config.get("model_type") != "mistral":
            raise UnsupportedModelError(f"config.json: text_config.model_type {spec.hf_config.get('model_type')!r} of "
                                        "a LLaVA model over a Pixtral tower is not supported (mistral)")
        # The "default" strategy drops each image's first row (CLIP's class token): a Pixtral tower has none, and
        # transformers would drop a patch and break the image's row layout.
        strategy = mm.get("vision_feature_select_strategy", "default")
        if strategy != "full":
            raise UnsupportedModelError(f"config.json: vision_feature_select_strategy {strategy!r} with a Pixtral "
                                        "tower is not supported (full)")
        layer = mm.get("vision_feature_layer", -2)
        if not isinstance(layer, int) or isinstance(layer, bool):
            raise UnsupportedModelError(f"config.json: vision_feature_layer {layer!r}: only one layer (an integer) "
                                        "is supported, not a list of layers")
        super().__init__(spec, dtype, device, kernels=kernels)
        self.vision_tower = PixtralVisionTower(mm.get("vision_config") or {}, dtype=dtype, device=vision_device(device),
                                               feature_layer=layer)
        self.multi_modal_projector = LlavaProjector(
            self.vision_tower.hidden_size, spec.hidden_size, str(mm.get("projector_hidden_act", "gelu")),
            bool(mm.get("multimodal_projector_bias", True)), dtype, vision_device(device))
        self._dtype = dtype

    def check_image_item(self, item: MultiModalItem) -> str | None:
        """What is wrong with an image item for this model (worker/multimodal.py check_items), or None."""
        return check_pixtral_item(item, self.vision_tower.num_channels, self.vision_tower.patch_size)

    def embed_image_item(self, item: MultiModalItem, device: torch.device) -> torch.Tensor:
        """[rows * cols, hidden]: the tower and projector over the image (one row per `[IMG]`)."""
        pixels = item.pixel_values().to(device=device, dtype=self._dtype)
        return self.multi_modal_projector(self.vision_tower([pixels]))
