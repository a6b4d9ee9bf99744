"""CLIP's vision tower (transformers' CLIPVisionModel; LLaVA's image encoder): vit.py's encoder with a
class token before the patches, a LayerNorm over the embeddings (`pre_layrnorm`) and a patch convolution
without bias. LLaVA takes its hidden states class token included; dropping it is the caller's choice."""

from __future__ import annotations

from ferrox.models.vision.vit import VisionTower


class CLIPVisionTower(VisionTower):
    model_type = "clip_vision_model"
    # CLIPVisionConfig's defaults (openai/clip-vit-base-patch32), for the keys the tower reads.
    config_defaults = {
        "hidden_size": 768,
        "intermediate_size": 3072,
        "num_hidden_layers": 12,
        "num_attention_heads": 12,
        "num_channels": 3,
        "image_size": 224,
        "patch_size": 32,
        "hidden_act": "quick_gelu",
        "layer_norm_eps": 1e-5,
    }
    has_class_token = True
    has_pre_layernorm = True
    has_patch_bias = False
