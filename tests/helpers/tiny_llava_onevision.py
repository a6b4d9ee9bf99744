"""A tiny random LLaVA-OneVision checkpoint (LlavaOnevisionForConditionalGeneration) for the model tests."""

from __future__ import annotations

import json
import os

from tests.helpers.tiny_models import (
    LLAVA_CHAT_TEMPLATE,
    _common,
    _randomize_norms,
    _save,
    _spread_vision,
    build_tokenizer,
)

# 35-pixel tiles of 7-pixel patches: 5x5 feature maps, an odd side, so a video frame's 2x2 pooling rounds up (to 3x3)
# and its bilinear weights are not a plain average.
ONEVISION_TILE, ONEVISION_PATCH = 35, 7
# (height, width) grid pinpoints: 1x1 .. 3x1 tiles, so images of different shapes take different grids.
ONEVISION_PINPOINTS = [[35 * rows, 35 * cols] for rows, cols in ((1, 1), (1, 2), (2, 1), (2, 2), (3, 1))]
# anyres_max_2: an unpadded map of more than 1.21 * 2 * 25 feature rows (a 2x2 or 3x1 grid) is scaled down
# bilinearly; a 1x2 or 2x1 grid's is not.
ONEVISION_ASPECT = "anyres_max_2"


def make_tiny_llava_onevision(folder, *, seed: int = 0) -> str:
    """A SigLIP tower of 35-pixel tiles and 7-pixel patches (5x5 rows a tile, last layer, "full" strategy), the
    projector, image_newline and a Qwen2 language model; `<image>` and `<video>` the last tokens of the
    vocabulary; LlavaOnevisionImageProcessor's preprocessor_config.json, its video processor's config and LlavaOnevisionProcessor's
    processor_config.json (ONEVISION_PINPOINTS, ONEVISION_ASPECT); the LLaVA chat template."""
    import torch
    from tokenizers import AddedToken
    from transformers import (
        LlavaOnevisionConfig,
        LlavaOnevisionForConditionalGeneration,
        Qwen2Config,
        SiglipVisionConfig,
    )
    from transformers.models.llava_onevision.image_processing_pil_llava_onevision import (
        LlavaOnevisionImageProcessorPil,
    )
    from transformers.models.llava_onevision.video_processing_llava_onevision import (
        LlavaOnevisionVideoProcessor,
    )

    tok = build_tokenizer()
    tok.add_tokens([AddedToken("<image>", special=True, normalized=False),
                    AddedToken("<video>", special=True, normalized=False)])
    text_config = Qwen2Config(**_common(tok, 64, 2, 4, 2, 128, 2048, False))
    vision_config = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                       num_attention_heads=2, image_size=ONEVISION_TILE, patch_size=ONEVISION_PATCH,
                                       vision_use_head=False)
    config = LlavaOnevisionConfig(vision_config=vision_config, text_config=text_config,
                                  image_token_index=tok.token_to_id("<image>"),
                                  video_token_index=tok.token_to_id("<video>"), vision_feature_layer=-1,
                                  vision_feature_select_strategy="full", projector_hidden_act="gelu",
                                  image_grid_pinpoints=ONEVISION_PINPOINTS, vision_aspect_ratio=ONEVISION_ASPECT)
    config.architectures = ["LlavaOnevisionForConditionalGeneration"]
    torch.manual_seed(seed)
    model = LlavaOnevisionForConditionalGeneration(config).to(torch.float32)
    _spread_vision(model, ("vision_tower", "multi_modal_projector", "image_newline"), vector_std=0.5)
    _randomize_norms(model)
    _save(str(folder), model, tok, max_shard_size=None, generation=None)
    size = {"height": ONEVISION_TILE, "width": ONEVISION_TILE}
    LlavaOnevisionImageProcessorPil(size=size,
                                    image_grid_pinpoints=ONEVISION_PINPOINTS).save_pretrained(str(folder))
    LlavaOnevisionVideoProcessor(size=size).save_pretrained(str(folder))
    with open(os.path.join(folder, "processor_config.json"), "w", encoding="utf-8") as f:
        json.dump({"processor_class": "LlavaOnevisionProcessor", "num_image_tokens": (ONEVISION_TILE // ONEVISION_PATCH) ** 2,
                   "vision_feature_select_strategy": "full", "vision_aspect_ratio": ONEVISION_ASPECT}, f, indent=2)
    with open(os.path.join(folder, "tokenizer_config.json"), encoding="utf-8") as f:
        tok_config = json.load(f)
    tok_config["chat_template"] = LLAVA_CHAT_TEMPLATE
    with open(os.path.join(folder, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(tok_config, f, indent=2)
    return str(folder)
