"""A tiny random Mistral 3 (Mistral3ForConditionalGeneration, written by transformers) whose vocabulary is the tiny
tekken's (tests/helpers/tiny_tekken.py: 1040 ids, [IMG] 10, [IMG_BREAK] 12, [IMG_END] 13) and whose tekken.json has
image settings matching its tower (4-pixel patches, 2x2 merge, longest edge 64: at most 8x8 image rows), for
--tokenizer-mode mistral's images: in Hugging Face's layout (config.json + model.safetensors + tekken.json: no
tokenizer.json, no preprocessor_config.json) and in Mistral's (params.json with its vision_encoder +
consolidated.safetensors + tekken.json)."""

from __future__ import annotations

import json
import os
from typing import Any

from tests.helpers.mistral_layout import write_mistral_folder
from tests.helpers.tiny_models import _randomize_norms, _spread_vision
from tests.helpers.tiny_tekken import NUM_SPECIAL, write_tekken

VOCAB = 1040
TEKKEN_IMAGE = {"image_patch_size": 4, "max_image_size": 64, "spatial_merge_size": 2}
IMAGE, BREAK, END = 10, 12, 13


def make_tekken_mistral3(folder, *, seed: int = 0) -> str:
    """The Hugging Face layout at `folder` (module docstring)."""
    import torch
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration

    text = dict(model_type="mistral", vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=2048,
                rms_norm_eps=1e-5, initializer_range=0.1, bos_token_id=1, eos_token_id=2, pad_token_id=11,
                sliding_window=None, tie_word_embeddings=False)
    vision = dict(model_type="pixtral", hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                  num_attention_heads=2, head_dim=16, patch_size=4, image_size=64, hidden_act="silu")
    config = Mistral3Config(text_config=text, vision_config=vision, image_token_index=IMAGE, vision_feature_layer=-1,
                            spatial_merge_size=2, tie_word_embeddings=False)
    config.architectures = ["Mistral3ForConditionalGeneration"]
    torch.manual_seed(seed)
    model = Mistral3ForConditionalGeneration(config).to(torch.float32)
    _spread_vision(model, ("vision_tower", "multi_modal_projector"), scale=lambda name, param: param.dim() == 1)
    _randomize_norms(model)
    model.save_pretrained(str(folder))
    write_tekken(folder, vocab=VOCAB - NUM_SPECIAL, image=TEKKEN_IMAGE)
    return str(folder)


def vision_encoder_params(hf_folder: str) -> dict[str, Any]:
    """params.json's vision_encoder for the folder's config.json."""
    with open(os.path.join(hf_folder, "config.json")) as f:
        config = json.load(f)
    v = config["vision_config"]
    return {"hidden_size": v["hidden_size"], "num_channels": 3, "max_image_size": v["image_size"],
            "patch_size": v["patch_size"], "rope_theta": (v.get("rope_parameters") or v)["rope_theta"],
            "intermediate_size": v["intermediate_size"], "num_hidden_layers": v["num_hidden_layers"],
            "num_attention_heads": v["num_attention_heads"], "image_token_id": IMAGE, "image_break_token_id": BREAK,
            "image_end_token_id": END, "spatial_merge_size": 2, "adapter_bias": False,
            "mm_projector_id": "patch_merge", "add_pre_mm_projector_layer_norm": True}


def write_native(hf_folder: str, dst) -> str:
    """The folder in Mistral's layout at `dst`: params.json, consolidated.safetensors, tekken.json."""
    return write_mistral_folder(hf_folder, dst, params={"vision_encoder": vision_encoder_params(hf_folder)})
