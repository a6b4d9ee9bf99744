"""Qwen2-Audio's audio encoder (transformers' Qwen2AudioEncoder): Whisper's encoder with an average pool.

A clip's log-mel frames [frames, num_mel_bins] (multimodal/qwen2_audio_processing.py keeps the frames its
positions read) go through a width-3 convolution and a width-3 stride-2 one (each followed by exact GELU), the
learned position embeddings (embed_positions, max_source_positions rows) added, pre-norm transformer layers
(LayerNorm, bidirectional multi-head attention: q and v projections with a bias, k without; LayerNorm, fc1, GELU,
fc2), an average pool of two positions, and the final LayerNorm. transformers runs the whole 30 s window and
masks the keys past the clip's positions; here only the clip's positions are computed, which gives the same rows
(masked keys add nothing) without the padding's work. The projector (multi_modal_projector: one linear layer
into the text width) is Qwen2AudioProjector.

Plain torch layers, whole on every rank under tensor parallelism (the model's tower runs every clip there).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ferrox.errors import UnsupportedModelError
from ferrox.models.load_check import load_tower_tensors

# Qwen2AudioEncoderConfig's defaults (Qwen2-Audio-7B's encoder), for the keys the encoder reads.
CONFIG_DEFAULTS: dict[str, Any] = {"num_mel_bins": 128, "encoder_layers": 32, "encoder_attention_heads": 20,
                                   "encoder_ffn_dim": 5120, "d_model": 1280, "max_source_positions": 1500,
                                   "activation_function": "gelu", "scale_embedding": False}
_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"gelu": F.gelu, "relu": F.relu}
_EPS = 1e-5  # nn.LayerNorm's default: transformers builds the encoder's norms with it


class WhisperAttention(nn.Module):
    def __init__(self, width: int, heads: int, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.heads = heads
        self.q_proj = nn.Linear(width, width, bias=True, dtype=dtype, device=device)
        self.k_proj = nn.Linear(width, width, bias=False, dtype=dtype, device=device)
        self.v_proj = nn.Linear(width, width, bias=True, dtype=dtype, device=device)
        self.out_proj = nn.Linear(width, width, bias=True, dtype=dtype, device=device)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        rows, width = h.shape

        def split(x: torch.Tensor) -> torch.Tensor:
            return x.view(rows, self.heads, width // self.heads).transpose(0, 1)

        out = F.scaled_dot_product_attention(split(self.q_proj(h)), split(self.k_proj(h)), split(self.v_proj(h)))
        return self.out_proj(out.transpose(0, 1).reshape(rows, width))


class WhisperEncoderLayer(nn.Module):
    def __init__(self, cfg: Mapping[str, Any], dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        width, ffn = int(cfg["d_model"]), int(cfg["encoder_ffn_dim"])
        self.self_attn = WhisperAttention(width, int(cfg["encoder_attention_heads"]), dtype, device)
        self.self_attn_layer_norm = nn.LayerNorm(width, eps=_EPS, dtype=dtype, device=device)
        self.fc1 = nn.Linear(width, ffn, dtype=dtype, device=device)
        self.fc2 = nn.Linear(ffn, width, dtype=dtype, device=device)
        self.final_layer_norm = nn.LayerNorm(width, eps=_EPS, dtype=dtype, device=device)
        self.act = _ACTIVATIONS[str(cfg["activation_function"])]

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = h + self.self_attn(self.self_attn_layer_norm(h))
        return h + self.fc2(self.act(self.fc1(self.final_layer_norm(h))))


def encoder_positions(frames: int) -> int:
    """Positions after the stride-2 convolution over `frames` log-mel frames."""
    return (frames - 1) // 2 + 1


def pooled_tokens(positions: int) -> int:
    """Audio tokens of `positions` encoder positions: the average pool of two (Qwen2AudioProcessor's count)."""
    return (positions - 2) // 2 + 1


class Qwen2AudioEncoder(nn.Module):
    """forward(features [frames, num_mel_bins]) -> [tokens, d_model]; `frames` as the processor keeps them
    (2 x positions + 1, or the whole window of 2 x max_source_positions)."""

    def __init__(self, config: Mapping[str, Any], *, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        cfg = {**CONFIG_DEFAULTS, **{k: v for k, v in config.items() if v is not None}}
        if str(cfg["activation_function"]) not in _ACTIVATIONS:
            raise UnsupportedModelError(f"audio_config.activation_function {cfg['activation_function']!r} is not "
                                        f"supported (supported: {', '.join(_ACTIVATIONS)})",
                                        param="audio_config.activation_function")
        if cfg["scale_embedding"]:  # (Qwen2AudioEncoder computes the scale and never applies it)
            raise UnsupportedModelError("audio_config.scale_embedding true is not supported (transformers' "
                                        "Qwen2AudioEncoder does not scale)", param="audio_config.scale_embedding")
        width, heads = int(cfg["d_model"]), int(cfg["encoder_attention_heads"])
        if width % heads:
            raise UnsupportedModelError(f"audio_config.d_model {width} is not a multiple of encoder_attention_heads "
                                        f"{heads}", param="audio_config.encoder_attention_heads")
        self.width = width
        self.mel_bins = int(cfg["num_mel_bins"])
        self.max_positions = int(cfg["max_source_positions"])
        self.conv1 = nn.Conv1d(self.mel_bins, width, kernel_size=3, padding=1, dtype=dtype, device=device)
        self.conv2 = nn.Conv1d(width, width, kernel_size=3, stride=2, padding=1, dtype=dtype, device=device)
        self.embed_positions = nn.Embedding(self.max_positions, width, dtype=dtype, device=device)
        self.layers = nn.ModuleList(WhisperEncoderLayer(cfg, dtype, device) for _ in range(int(cfg["encoder_layers"])))
        self.layer_norm = nn.LayerNorm(width, eps=_EPS, dtype=dtype, device=device)

    def positions_of(self, frames: int) -> int:
        """The clip's encoder positions for `frames` kept frames (the inverse of the processor's kept_frames)."""
        return min(self.max_positions, frames // 2)

    def check_features(self, shape: list[int]) -> str | None:
        """What is wrong with a clip's features of this shape for this encoder, or None."""
        if len(shape) != 2 or shape[1] != self.mel_bins:
            return f"features {shape}: the audio encoder takes [frames, {self.mel_bins}] log-mel frames"
        frames, window = shape[0], 2 * self.max_positions
        if frames > window or pooled_tokens(self.positions_of(frames)) < 1 or (
                frames < window and frames % 2 == 0):
            return (f"features {shape}: {frames} frames is not a clip's kept frames (odd, from 5 up to the "
                    f"{window}-frame window)")
        return None

    def tokens_of(self, frames: int) -> int:
        return pooled_tokens(self.positions_of(frames))

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        positions = self.positions_of(features.shape[0])
        x = features.to(self.conv1.weight.dtype).t().unsqueeze(0)
        x = F.gelu(self.conv2(F.gelu(self.conv1(x))))[0, :, :positions].t()
        h = x + self.embed_positions.weight[:positions]
        for layer in self.layers:
            h = layer(h)
        tokens = pooled_tokens(positions)
        h = h[:2 * tokens].view(tokens, 2, self.width).mean(dim=1)
        return self.layer_norm(h)

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        """Names under the encoder (`conv1.weight`, `layers.0.fc1.bias`, ...). Every parameter must be set."""
        load_tower_tensors(self, weights, "Qwen2-Audio audio encoder")


class Qwen2AudioProjector(nn.Module):
    """transformers' Qwen2AudioMultiModalProjector: one linear layer from the encoder's width to the text's."""

    def __init__(self, audio_width: int, text_hidden: int, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.linear = nn.Linear(audio_width, text_hidden, bias=True, dtype=dtype, device=device)

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        return self.linear(rows)
