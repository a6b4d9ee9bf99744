"""A tiny random InternVL checkpoint in transformers' own layout (InternVLForConditionalGeneration, the hub's
InternVL3 / InternVL3.5 "-hf" repos), with the tokenizer, processor files and chat template its
InternVLProcessor loads from."""

from __future__ import annotations

import json
import os
from typing import Any

from tests.helpers.tiny_models import _common, _randomize_norms, _save, _spread_vision, build_tokenizer

# The tokens InternVLProcessor reads off the tokenizer (its extra_special_tokens), as the hub's tokenizers
# name them.
INTERNVL_TOKENS = {"start_image_token": "<img>", "end_image_token": "</img>",
                   "context_image_token": "<IMG_CONTEXT>", "video_token": "<video>"}
# The hub's -hf chat templates write `<IMG_CONTEXT>\n` for an image part.
INTERNVL_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'image' %}<IMG_CONTEXT>\n"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TILE = 56  # pixels a tile side: 8x8 patches of 7, pixel shuffled to 4x4 = 16 rows a tile
TOKENS_PER_TILE = 16


def make_tiny_internvl(folder, *, text: str = "qwen2", seed: int = 0) -> str:
    """text: "qwen2" (InternVL3's language model; a LayerNorm InternViT with q/k/v bias, as InternViT-300M) or
    "qwen3" (InternVL3.5's; an RMSNorm InternViT with q/k norms, as InternViT-6B). The vision tower: 56-pixel
    tiles of 7-pixel patches, 32 wide, 2 layers; GotOcr2ImageProcessor's preprocessor_config.json with at most
    4 tiles an image (plus the thumbnail), InternVLProcessor's processor_config.json (16 tokens a tile)."""
    import torch
    from tokenizers import AddedToken
    from transformers import (
        GotOcr2ImageProcessorPil,
        InternVLConfig,
        InternVLForConditionalGeneration,
        Qwen2Config,
        Qwen3Config,
    )

    tok = build_tokenizer()
    tok.add_tokens([AddedToken(t, special=True, normalized=False) for t in INTERNVL_TOKENS.values()])
    common = _common(tok, 64, 2, 4, 2, 128, 2048, False)
    text_config: Any = (Qwen2Config(**common) if text == "qwen2"
                        else Qwen3Config(**common, head_dim=16))
    rms = text == "qwen3"
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=TILE,
                  patch_size=7, norm_type="rms_norm" if rms else "layer_norm", use_qk_norm=rms,
                  attention_bias=not rms, layer_scale_init_value=1.0)
    config = InternVLConfig(text_config=text_config.to_dict(), vision_config=vision,
                            image_token_id=tok.token_to_id("<IMG_CONTEXT>"), image_seq_length=TOKENS_PER_TILE,
                            downsample_ratio=0.5, tie_word_embeddings=False)
    config.architectures = ["InternVLForConditionalGeneration"]
    torch.manual_seed(seed)
    model = InternVLForConditionalGeneration(config).to(torch.float32)
    # Layer scales (lambda_1/2) and the projector's LayerNorm drawn around 1 too, so they are tested.
    _spread_vision(model, ("vision_tower", "multi_modal_projector"),
                   scale=lambda name, param: param.dim() == 1 and ("norm" in name or "lambda" in name)
                   and name.endswith(("weight", "lambda_1", "lambda_2")))
    _randomize_norms(model)
    with torch.no_grad():  # image rows about as large as token embeddings, so neither drowns the other
        for param in model.model.multi_modal_projector.linear_2.parameters():
            param.mul_(0.05)
    _save(str(folder), model, tok, max_shard_size=None, generation=None)
    with open(os.path.join(folder, "tokenizer_config.json"), encoding="utf-8") as f:
        tok_config = json.load(f)
    tok_config["chat_template"] = INTERNVL_CHAT_TEMPLATE
    tok_config["extra_special_tokens"] = dict(INTERNVL_TOKENS)
    with open(os.path.join(folder, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(tok_config, f, indent=2)
    images = GotOcr2ImageProcessorPil(size={"height": TILE, "width": TILE}, crop_to_patches=True, min_patches=1,
                                      max_patches=4)
    images.save_pretrained(str(folder))  # preprocessor_config.json
    # The hub's processor_config.json (transformers cannot build InternVLProcessor without torchvision, which
    # its video processor needs: tests build it with no_video_processor below).
    with open(os.path.join(folder, "processor_config.json"), "w", encoding="utf-8") as f:
        json.dump({"processor_class": "InternVLProcessor", "image_seq_length": TOKENS_PER_TILE}, f, indent=2)
    return str(folder)


def internvl_processor(folder) -> Any:
    """transformers' InternVLProcessor of a tiny folder, built without a video processor (its class needs
    torchvision, which the test environment lacks; images never reach it)."""
    from transformers import GotOcr2ImageProcessorPil, InternVLProcessor, PreTrainedTokenizerFast

    class ImagesOnly(InternVLProcessor):
        def check_argument_for_proper_class(self, argument_name, argument):
            if argument_name == "video_processor" and argument is None:
                return None
            return super().check_argument_for_proper_class(argument_name, argument)

    with open(os.path.join(folder, "processor_config.json"), encoding="utf-8") as f:
        seq = json.load(f)["image_seq_length"]
    return ImagesOnly(GotOcr2ImageProcessorPil.from_pretrained(str(folder)),
                      PreTrainedTokenizerFast.from_pretrained(str(folder)), None, image_seq_length=seq)
