"""LLaVA-OneVision (LlavaOnevisionForConditionalGeneration: llava-onevision-qwen2-0.5b / 7b / 72b-ov-hf): LLaVA-NeXT's
anyres images (models/llava_next.py) over a SigLIP tower and a Qwen2 language model. As transformers'
LlavaOnevisionModel, its images differ in two things, both carried by the layout
(multimodal/llava_onevision_processing.py): config.json's defaults (the "full" strategy, the last layer,
1..6 x 1..6 tile pinpoints), and "anyres_max_N", which scales an image's unpadded feature map down bilinearly when
it is larger than about N tiles' rows, before the newlines are added.

Videos (items of modality "video", `<video>` tokens: multimodal/llava_onevision_video.py): each frame through the
tower and projector, its p x p map scaled bilinearly to ceil(p/2) a side, the frames' rows one after the other,
then one image_newline. Checkpoint names, weights and tensor parallelism are LLaVA-NeXT's.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from ferrox.model_spec import ModelSpec, UnsupportedModelError
from ferrox.models.llava_next import LlavaNextForConditionalGeneration
from ferrox.multimodal.inputs import MultiModalItem
from ferrox.multimodal.llava_next_processing import AnyresLayout
from ferrox.multimodal.llava_onevision_processing import onevision_config, onevision_layout
from ferrox.multimodal.llava_onevision_video import pooled_side


class LlavaOnevisionForConditionalGeneration(LlavaNextForConditionalGeneration):
    takes_videos = True

    def __init__(self, spec: ModelSpec, dtype: torch.dtype, device: torch.device | str, *,
                 kernels: str | None = None):
        # config.json leaves out the fields equal to LlavaOnevisionConfig's defaults, which are not LLaVA's:
        # filled in before LLaVA's constructor reads them.
        mm = spec.hf_config["multimodal"] = onevision_config(spec.hf_config["multimodal"])
        # LlavaOnevisionConfig ties the output embedding when either its own or text_config's flag says so;
        # ferrox's language model reads text_config's.
        if mm.get("tie_word_embeddings") and not spec.hf_config.get("tie_word_embeddings"):
            raise UnsupportedModelError("config.json: tie_word_embeddings true over a text_config that does not tie "
                                        "its embeddings is not supported")
        super().__init__(spec, dtype, device, kernels=kernels)

    @staticmethod
    def anyres_layout(multimodal: dict[str, Any]) -> AnyresLayout:
        return onevision_layout(multimodal)

    def check_image_item(self, item: MultiModalItem) -> str | None:
        if item.modality != "video":
            return super().check_image_item(item)
        side, frames = self.layout.tile, item.shape[0] if item.shape else 0
        tokens = frames * pooled_side(self.layout.patches) ** 2 + 1
        if frames < 1 or list(item.shape) != [frames, self.vision_tower.num_channels, side, side]:
            return f"video pixels {list(item.shape)}, not [frames, {self.vision_tower.num_channels}, {side}, {side}]"
        if item.length != tokens or item.embed_positions is not None:
            return f"{item.length} placeholder tokens for a video of {frames} frames (it takes {tokens})"
        return None

    def embed_image_item(self, item: MultiModalItem, device: torch.device) -> torch.Tensor:
        if item.modality != "video":
            return super().embed_image_item(item, device)
        features = self.embed_multimodal(item.pixel_values().to(device=device, dtype=self._dtype))
        frames, _, hidden = features.shape
        p, q = self.layout.patches, pooled_side(self.layout.patches)
        maps = features.view(frames, p, p, hidden).permute(0, 3, 1, 2)
        pooled = F.interpolate(maps, size=(q, q), mode="bilinear").permute(0, 2, 3, 1).reshape(-1, hidden)
        return torch.cat([pooled, self.image_newline.to(pooled.dtype)[None]])
