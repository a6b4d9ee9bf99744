"""Qwen2-Audio (Qwen2AudioForConditionalGeneration: Qwen2-Audio-7B and -7B-Instruct): the Whisper-style audio
encoder with its average pool (models/vision/whisper_encoder.py), a one-layer projector into the text width, and
ferrox's Qwen2 language model, which reads each clip's projected rows in place of its run of `<|AUDIO|>` tokens
(multimodal/qwen2_audio_processing.py counts and expands them), causal attention throughout, so a clip may be cut
over prefill chunks (its rows kept until the prefill passes it: worker/multimodal.py).

Checkpoint names are transformers': `audio_tower.*`, `multi_modal_projector.*`, `language_model.model.*`,
`language_model.lm_head.*` (the released layout), or with transformers 5's `model.` prefixes
(`model.audio_tower.*`, `model.multi_modal_projector.*`, `model.language_model.*`, `lm_head.*`). Unquantized.
Under tensor parallelism the language model is sharded as Qwen2's is; the encoder and projector load whole on
every rank, each of which encodes its requests' clips. Images and videos are refused by name (the front-end's
prompt rules; the worker's check_image_item).
"""

from __future__ import annotations

from typing import Any

import torch

from ferrox.model_spec import ModelSpec
from ferrox.models.llava import LlavaLayoutWeights
from ferrox.models.qwen import Qwen2ForCausalLM
from ferrox.models.vision.encoder_setup import vision_device
from ferrox.multimodal.inputs import MultiModalItem

AUDIO_MODALITY = "audio"
class Qwen2AudioForConditionalGeneration(LlavaLayoutWeights, Qwen2ForCausalLM):
    # Loaded as LLaVA's layout is (models/llava.py): the language model, `audio_tower.*`, `multi_modal_projector.*`.
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

    @staticmethod
    def takes_audio_of(hf_config: Any) -> bool:
        """Every Qwen2-Audio checkpoint has its audio encoder (models/vision/encoder_setup.py text_only_model)."""
        return True

    def __init__(self, spec: ModelSpec, dtype: torch.dtype, device: torch.device | str, *,
                 kernels: str | None = None):
        from ferrox.models.vision.whisper_encoder import Qwen2AudioEncoder, Qwen2AudioProjector

        super().__init__(spec, dtype, device, kernels=kernels)
        mm = spec.hf_config.get("multimodal") or {}
        # (on the vision device: --language-model-only leaves the encoder unbuilt)
        self.audio_tower = Qwen2AudioEncoder(mm.get("audio_config") or {}, dtype=dtype, device=vision_device(device))
        self.multi_modal_projector = Qwen2AudioProjector(self.audio_tower.width, spec.hidden_size, dtype,
                                                         vision_device(device))

    def check_image_item(self, item: MultiModalItem) -> str | None:
        """What is wrong with an item for this model (worker/multimodal.py check_items), or None."""
        from ferrox.models.vision.whisper_encoder import Qwen2AudioEncoder

        if item.modality != AUDIO_MODALITY:
            return f"a {item.modality} item: Qwen2-Audio takes audio clips only"
        tower = getattr(self, "audio_tower", None)
        if not isinstance(tower, Qwen2AudioEncoder):  # (--language-model-only left it unbuilt)
            return "the model takes no audio (its audio encoder is not loaded)"
        problem = tower.check_features(list(item.shape))
        if problem:
            return problem
        tokens = tower.tokens_of(item.shape[0])
        if item.length != tokens:
            return f"{item.length} placeholder tokens for {item.shape[0]} log-mel frames (they give {tokens})"
        return None

    def embed_image_item(self, item: MultiModalItem, device: torch.device) -> torch.Tensor:
        """[item.length, hidden]: the encoder and projector over a clip's log-mel frames."""
        return self.multi_modal_projector(self.audio_tower(item.pixel_values().to(device)))
