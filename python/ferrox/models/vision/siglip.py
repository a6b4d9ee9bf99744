"""SigLIP's vision tower (transformers' SiglipVisionModel; Gemma 3's and some LLaVA variants' image
encoder): vit.py's encoder over the patches alone (no class token, no LayerNorm before the encoder),
the patch convolution with a bias. Its attention-pooling head (`head.*`) serves the contrastive loss,
so it is never built."""

from __future__ import annotations

from ferrox.models.vision.vit import VisionTower


class SiglipVisionTower(VisionTower):
    model_type = "siglip_vision_model"
    # SiglipVisionConfig's defaults (google/siglip-base-patch16-224), for the keys the tower reads.
    config_defaults = {
        "hidden_size": 768,
        "intermediate_size": 3072,
        "num_hidden_layers": 12,
        "num_attention_heads": 12,
        "num_channels": 3,
        "image_size": 224,
        "patch_size": 16,
        "hidden_act": "gelu_pytorch_tanh",
        "layer_norm_eps": 1e-6,
    }
    has_class_token = False
    has_pre_layernorm = False
    has_patch_bias = True
