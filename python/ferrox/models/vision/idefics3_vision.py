"""Idefics3's vision tower (transformers' Idefics3VisionTransformer; SmolVLM's is the same): SigLIP's encoder
(vit.py: no class token, no LayerNorm before the encoder, a bias on the patch convolution) always followed
by its post_layernorm, with NaViT-style positions.

Idefics3VisionEmbeddings places a grid of patches that may be smaller than the tower's own (a padded image)
on the tower's position grid by bucketing each patch's fractional coordinate (i / patches) against the
boundaries k / side. For a full tile the grid is the tower's own, yet the float32 bucketing is not always
the identity (sides 19, 25, 29, ... put some patches on a neighbour's position; 26, 27 and 32, the hub
checkpoints' sides, do not), so each patch's position is computed with transformers' float32 ops, once,
at build time. ferrox feeds it full tiles only (the processor cuts
images into tower-sized squares: multimodal/idefics3_processing.py), so no patch is masked.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ferrox.errors import InvalidArgumentError
from ferrox.models.vision.vit import VisionTower


class Idefics3VisionTower(VisionTower):
    model_type = "idefics3_vision"
    # Idefics3VisionConfig's defaults (SmolVLMVisionConfig's are the same).
    config_defaults = {
        "hidden_size": 1152,
        "intermediate_size": 3072,
        "num_hidden_layers": 12,
        "num_attention_heads": 16,
        "num_channels": 3,
        "image_size": 224,
        "patch_size": 32,
        "hidden_act": "gelu_pytorch_tanh",
        "layer_norm_eps": 1e-6,
    }
    has_class_token = False
    has_pre_layernorm = False
    has_patch_bias = True

    def __init__(self, config: Mapping[str, Any], *, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__(config, dtype=dtype, device=device, feature_layer=-1, post_layernorm=True)
        side = self.image_size // self.patch_size
        self.register_buffer("position_ids", _bucketed_positions(side, side, side).to(device), persistent=False)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[B, C, image_size, image_size] -> the post_layernorm'd last hidden state [B, patches, hidden]."""
        expected = (self.num_channels, self.image_size, self.image_size)
        if pixel_values.dim() != 4 or tuple(pixel_values.shape[1:]) != expected:
            raise InvalidArgumentError(f"pixel_values: expected [batch, {', '.join(map(str, expected))}] (this "
                                       f"{self.model_type} tower takes {self.image_size}x{self.image_size} tiles), got "
                                       f"{list(pixel_values.shape)}", param="pixel_values")
        embeddings = self.embeddings
        h = embeddings.patch_embedding(pixel_values.to(embeddings.patch_embedding.weight.dtype)).flatten(2).transpose(1, 2)
        h = h + embeddings.position_embedding(self.position_ids)
        for layer in self.encoder.layers:
            h = layer(h)
        assert self.post_layernorm is not None  # built: post_layernorm=True
        return self.post_layernorm(h)


def _bucketed_positions(patches_h: int, patches_w: int, side: int) -> torch.Tensor:
    """Idefics3VisionEmbeddings' position ids of an unmasked patches_h x patches_w grid on a side x side
    tower grid, [patches_h * patches_w], in transformers' float32 arithmetic."""
    boundaries = torch.arange(1 / side, 1.0, 1 / side)
    step_h = 1.0 / torch.tensor([patches_h])
    step_w = 1.0 / torch.tensor([patches_w])
    coords_h = torch.clamp(torch.arange(patches_h, dtype=torch.float32)[None, :] * step_h[:, None], max=1.0 - 1e-6)
    coords_w = torch.clamp(torch.arange(patches_w, dtype=torch.float32)[None, :] * step_w[:, None], max=1.0 - 1e-6)
    bucket_h = torch.bucketize(coords_h, boundaries, right=True)
    bucket_w = torch.bucketize(coords_w, boundaries, right=True)
    return (bucket_h[:, :, None] * side + bucket_w[:, None, :]).reshape(-1)
