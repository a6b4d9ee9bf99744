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

import torch

from ferrox.model_spec import ModelSpec
from ferrox.models.audio_layout import AudioTowerModel
from ferrox.models.qwen import Qwen2ForCausalLM
from ferrox.models.vision.encoder_setup import vision_device
from ferrox.models.vision.whisper_encoder import Qwen2AudioEncoder, Qwen2AudioProjector


class Qwen2AudioForConditionalGeneration(AudioTowerModel, Qwen2ForCausalLM):
    family = "Qwen2-Audio"
    encoder_class = Qwen2AudioEncoder

    def __init__(self, spec: ModelSpec, dtype: torch.dtype, device: torch.device | str, *,
                 kernels: str | None = None):
        super().__init__(spec, dtype, device, kernels=kernels)
        mm = spec.hf_config.get("multimodal") or {}
        # (on the vision device: --language-model-only leaves the encoder unbuilt)
        self.audio_tower = Qwen2AudioEncoder(mm.get("audio_config") or {}, dtype=dtype, device=vision_device(device))
        self.multi_modal_projector = Qwen2AudioProjector(self.audio_tower.width, spec.hidden_size, dtype,
                                                         vision_device(device))

    def audio_tokens(self, frames: int) -> int:
        return self.audio_tower.tokens_of(frames)
