"""Vision encoders for image inputs: CLIP's and SigLIP's ViT towers (vit.py holds the shared encoder).

    tower = build_vision_tower(hf_config["vision_config"], dtype=..., device=..., feature_layer=-2)
    tower.load_weights(names and tensors under vision_model.)   # vision_tower. prefix stripped by the caller
    features = tower(pixel_values)                              # [B, tokens, hidden]
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ferrox.errors import UnsupportedModelError
from ferrox.models.vision.clip import CLIPVisionTower
from ferrox.models.vision.siglip import SiglipVisionTower
from ferrox.models.vision.vit import VisionTower

__all__ = ["VisionTower", "build_vision_tower"]

# vision_config.model_type -> the tower.
_TOWERS: dict[str, type[VisionTower]] = {t.model_type: t for t in (CLIPVisionTower, SiglipVisionTower)}


def build_vision_tower(config: Mapping[str, Any], *, dtype: torch.dtype, device: torch.device | str,
                       feature_layer: int = -1, post_layernorm: bool = False) -> VisionTower:
    """The tower a checkpoint's vision_config describes (keys it leaves out take transformers' defaults),
    built up to hidden_states[feature_layer]; post_layernorm (last layer only) adds the final LayerNorm,
    as transformers' last_hidden_state for SigLIP has it. Its parameters are unset: load_weights next."""
    model_type = config.get("model_type")
    tower = _TOWERS.get(model_type) if isinstance(model_type, str) else None
    if tower is None:
        raise UnsupportedModelError(f"vision_config.model_type {model_type!r} is not supported (supported: "
                                    f"{', '.join(_TOWERS)})", param="vision_config.model_type")
    return tower(config, dtype=dtype, device=device, feature_layer=feature_layer, post_layernorm=post_layernorm)
