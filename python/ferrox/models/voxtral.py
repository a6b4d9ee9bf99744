"""Voxtral (VoxtralForConditionalGeneration: mistralai/Voxtral-Mini-3B-2507, Voxtral-Small-24B-2507): Whisper's
encoder run over whole 30 s windows, a projector reading its rows four at a time, and ferrox's Llama, which reads
each clip's projected rows in place of its run of [AUDIO] tokens (multimodal/voxtral_processing.py counts and
expands them), causal attention throughout, so a clip may be cut over prefill chunks (worker/multimodal.py).

The encoder (transformers' VoxtralEncoder) is Qwen2-Audio's Whisper encoder (models/vision/whisper_encoder.py)
without its average pool and without a mask: every window's 1,500 positions, the clip's padding included, attend
to each other, then the final LayerNorm. Its position table stays in float32 (transformers keeps it so: the sum
is rounded to the model's dtype afterwards). A clip of several windows encodes each apart and concatenates them.
The projector (VoxtralMultiModalProjector): the encoder's rows grouped intermediate_size / hidden_size at a time
(4), linear_1 (no bias) into the text width, GELU, linear_2 (no bias).

Checkpoint names are transformers' (the hub's Hugging Face layout): `audio_tower.*`, `multi_modal_projector.*`,
`language_model.model.*`, `language_model.lm_head.*`, or with transformers 5's `model.` prefixes. Mistral's
native layout (params.json's multimodal.whisper_model_args, consolidated.safetensors) is refused by name by the
params.json reader (loader/mistral_config.py). Unquantized. Under tensor parallelism the language model is
sharded as Llama's; the encoder and projector load whole on every rank. Images and videos are refused by name.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ferrox.errors import UnsupportedModelError
from ferrox.model_spec import ModelSpec
from ferrox.models.audio_layout import AudioTowerModel
from ferrox.models.llama import LlamaForCausalLM
from ferrox.models.load_check import load_tower_tensors
from ferrox.models.vision.encoder_setup import vision_device
from ferrox.models.vision.whisper_encoder import Qwen2AudioEncoder

# VoxtralEncoderConfig's names -> the Whisper names models/vision/whisper_encoder.py reads.
_ENCODER_NAMES = {"hidden_size": "d_model", "num_hidden_layers": "encoder_layers",
                  "num_attention_heads": "encoder_attention_heads", "intermediate_size": "encoder_ffn_dim"}


def encoder_config(audio_config: Mapping[str, Any]) -> dict[str, Any]:
    """config.json's audio_config in Whisper's names (a Whisper-named key given too must agree)."""
    out = dict(audio_config)
    for name, whisper in _ENCODER_NAMES.items():
        if name in audio_config:
            if whisper in audio_config and audio_config[whisper] != audio_config[name]:
                raise UnsupportedModelError(f"config.json: audio_config.{name} {audio_config[name]} and "
                                            f"{whisper} {audio_config[whisper]} disagree", param=f"audio_config.{name}")
            out[whisper] = audio_config[name]
    return out


class VoxtralEncoder(Qwen2AudioEncoder):
    """forward(features [windows x 2 x max_source_positions, num_mel_bins]) -> [windows x max_source_positions,
    d_model]: each window's rows (module docstring)."""

    def __init__(self, config: Mapping[str, Any], *, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__(encoder_config(config), dtype=dtype, device=device)
        self.embed_positions = nn.Embedding(self.max_positions, self.width, dtype=torch.float32, device=device)
        self.window_frames = 2 * self.max_positions

    def check_features(self, shape: list[int]) -> str | None:
        if len(shape) != 2 or shape[1] != self.mel_bins or shape[0] < 1 or shape[0] % self.window_frames:
            return (f"features {shape}: the audio encoder takes whole {self.window_frames}-frame windows of "
                    f"{self.mel_bins} log-mel bins")
        return None

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        windows = features.shape[0] // self.window_frames
        x = features.to(self.conv1.weight.dtype).view(windows, self.window_frames, self.mel_bins).transpose(1, 2)
        x = F.gelu(self.conv2(F.gelu(self.conv1(x)))).transpose(1, 2)  # [windows, positions, width]
        h = (x + self.embed_positions.weight).to(x.dtype)
        rows = []
        for window in h:  # (the layers attend within one window: 1,500 positions each)
            for layer in self.layers:
                window = layer(window)
            rows.append(self.layer_norm(window))
        return torch.cat(rows)

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        load_tower_tensors(self, weights, "Voxtral audio encoder")


class VoxtralProjector(nn.Module):
    """transformers' VoxtralMultiModalProjector over the encoder's rows grouped `group` at a time."""

    def __init__(self, audio_width: int, group: int, text_hidden: int, act: str, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        super().__init__()
        if act != "gelu":
            raise UnsupportedModelError(f"config.json: projector_hidden_act {act!r} is not supported (gelu)",
                                        param="projector_hidden_act")
        self.group_width = audio_width * group
        self.linear_1 = nn.Linear(self.group_width, text_hidden, bias=False, dtype=dtype, device=device)
        self.linear_2 = nn.Linear(text_hidden, text_hidden, bias=False, dtype=dtype, device=device)

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        return self.linear_2(F.gelu(self.linear_1(rows.reshape(-1, self.group_width))))


class VoxtralForConditionalGeneration(AudioTowerModel, LlamaForCausalLM):
    family = "Voxtral"
    encoder_class = VoxtralEncoder

    def __init__(self, spec: ModelSpec, dtype: torch.dtype, device: torch.device | str, *,
                 kernels: str | None = None):
        from ferrox.multimodal.voxtral_processing import encoder_group

        mm = spec.hf_config.get("multimodal") or {}
        audio = encoder_config(mm.get("audio_config") or {})
        super().__init__(spec, dtype, device, kernels=kernels)
        self.audio_tower = VoxtralEncoder(audio, dtype=dtype, device=vision_device(device))
        group = encoder_group(audio)
        if self.audio_tower.max_positions % group:
            raise UnsupportedModelError(f"config.json: audio_config.max_source_positions "
                                        f"{self.audio_tower.max_positions} is not a multiple of the projector's "
                                        f"group of {group} encoder rows", param="audio_config.max_source_positions")
        self.tokens_per_window = self.audio_tower.max_positions // group
        self.multi_modal_projector = VoxtralProjector(self.audio_tower.width, group, spec.hidden_size,
                                                      str(mm.get("projector_hidden_act", "gelu")), dtype,
                                                      vision_device(device))

    def audio_tokens(self, frames: int) -> int:
        """tokens_per_window for each whole window (the clip is padded to whole windows)."""
        return frames // self.audio_tower.window_frames * self.tokens_per_window
