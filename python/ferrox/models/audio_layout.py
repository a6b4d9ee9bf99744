"""What the audio-only LLaVA-layout families (Qwen2-Audio, Voxtral) share:
an `audio_tower` and a `multi_modal_projector` beside the language model, loaded as LLaVA's layout is
(models/llava.py), each clip's projected rows in place of its run of audio tokens. A family subclasses
AudioTowerModel before its language model's class and sets `family` and `encoder_class`; its __init__ builds
`self.audio_tower` (an encoder_class) and `self.multi_modal_projector`, and `audio_tokens` says how many rows a
clip of so many log-mel frames gives.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from ferrox.models.llava import LlavaLayoutWeights
from ferrox.multimodal.inputs import MultiModalItem

AUDIO_MODALITY = "audio"


class AudioTowerModel(LlavaLayoutWeights):
    tower_name = "audio_tower"
    # The worker's multimodal path (worker/multimodal.py) is entered through takes_images: the items it takes
    # here are audio clips only (check_image_item refuses an image by name).
    takes_images = True
    takes_videos = False
    takes_audio = True
    # Its one modality: --limit-mm-per-prompt audio 0 (or --language-model-only) leaves the encoder unbuilt
    # (models/vision/encoder_setup.py text_only_model).
    media_modalities = ("audio",)
    supports_quantized_gguf = False
    supports_quantization = False
    own_weight_prefixes: tuple[str, ...] = ("audio_tower.", "multi_modal_projector.")
    family: ClassVar[str]
    encoder_class: ClassVar[type[Any]]
    # Built by the family's __init__ (left unbuilt by --language-model-only: check_image_item looks).
    audio_tower: Any
    multi_modal_projector: Any

    @staticmethod
    def takes_audio_of(hf_config: Any) -> bool:
        """Every checkpoint of these families has its audio encoder (models/vision/encoder_setup.py
        text_only_model)."""
        return True

    def audio_tokens(self, frames: int) -> int:
        """The projected rows (audio tokens) of a clip of `frames` log-mel frames."""
        raise NotImplementedError

    def check_image_item(self, item: MultiModalItem) -> str | None:
        """What is wrong with an item for this model (worker/multimodal.py check_items), or None."""
        if item.modality != AUDIO_MODALITY:
            return f"a {item.modality} item: {self.family} takes audio clips only"
        tower: Any = getattr(self, "audio_tower", None)
        if not isinstance(tower, self.encoder_class):  # (--language-model-only left it unbuilt)
            return "the model takes no audio (its audio encoder is not loaded)"
        problem = tower.check_features(list(item.shape))
        if problem:
            return problem
        tokens = self.audio_tokens(item.shape[0])
        if item.length != tokens:
            return f"{item.length} placeholder tokens for {item.shape[0]} log-mel frames (they give {tokens})"
        return None

    def embed_image_item(self, item: MultiModalItem, device: torch.device) -> torch.Tensor:
        """[item.length, hidden]: the encoder and projector over a clip's log-mel frames."""
        return self.multi_modal_projector(self.audio_tower(item.pixel_values().to(device)))
