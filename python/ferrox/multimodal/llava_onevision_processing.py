"""LLaVA-OneVision images: LLaVA-NeXT's anyres tiles (llava_next_processing.py) under OneVision's defaults.

What differs from LLaVA-NeXT, as transformers' LlavaOnevisionConfig, LlavaOnevisionImageProcessor (the PIL one)
and LlavaOnevisionProcessor have it:
- config.json's defaults (it leaves out the fields equal to them): a SigLIP tower of 384-pixel images and
  14-pixel patches, its last layer, the "full" strategy (every row kept), grid pinpoints of 1..6 x 1..6 tiles,
  vision_aspect_ratio "anyres_max_9";
- "anyres_max_N": an image's unpadded feature map larger than about N tiles' rows is scaled down bilinearly
  (AnyresLayout.scaled), which its placeholder count follows;
- the image processor: size {384, 384} and no center crop, tiles cut at size's side.

Each image of a prompt is tiled on its own, as LlavaOnevisionProcessor does with a prompt's flat list of images
(and vLLM with every image); transformers' other mode, a nested list's images of one prompt each squashed to a
single padded square, is not taken. Videos: llava_onevision_video.py.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Any

from ferrox.errors import ModelLoadError, UnsupportedModelError
from ferrox.multimodal.config_fields import PROCESSOR_FILE, read_json_object
from ferrox.multimodal.llava_next_processing import (
    AnyresLayout,
    LlavaNextImageProcessor,
    LlavaNextImagePrompts,
)
from ferrox.multimodal.llava_onevision_video import LlavaOnevisionVideoProcessor

ONEVISION_PINPOINTS = [[384 * rows, 384 * cols] for rows in range(1, 7) for cols in range(1, 7)]
# LlavaOnevisionConfig's defaults, where they differ from LLaVA-NeXT's (the tower's: its vision_config).
_CONFIG_DEFAULTS: dict[str, Any] = {
    "vision_config": {"model_type": "siglip_vision_model", "hidden_size": 1152, "intermediate_size": 4304,
                      "patch_size": 14, "image_size": 384, "num_hidden_layers": 26, "num_attention_heads": 16,
                      "vision_use_head": False},
    "image_token_index": 151_646, "video_token_index": 151_647, "vision_feature_select_strategy": "full",
    "vision_feature_layer": -1, "image_grid_pinpoints": ONEVISION_PINPOINTS, "vision_aspect_ratio": "anyres_max_9",
}
_ASPECT = re.compile(r"anyres_max_([1-9][0-9]*)")


def onevision_config(multimodal: Mapping[str, Any]) -> dict[str, Any]:
    """config.json's top level (or the model's `multimodal`) with LlavaOnevisionConfig's defaults filled in."""
    out = {**_CONFIG_DEFAULTS, **{k: v for k, v in multimodal.items() if v is not None}}
    if "model_type" not in out["vision_config"]:  # LlavaOnevisionConfig's sub-config default
        out["vision_config"] = {"model_type": "siglip_vision_model", **out["vision_config"]}
    return out


def max_tiles(multimodal: Mapping[str, Any], where: str = "config.json") -> int:
    """N of vision_aspect_ratio "anyres_max_N" (the only form transformers reads)."""
    value = multimodal.get("vision_aspect_ratio", "anyres_max_9")
    found = _ASPECT.fullmatch(value) if isinstance(value, str) else None
    if found is None:
        raise UnsupportedModelError(f"{where}: vision_aspect_ratio {value!r} is not supported (anyres_max_N)")
    return int(found.group(1))


def onevision_layout(multimodal: Mapping[str, Any]) -> AnyresLayout:
    """The images' geometry by config.json (defaults filled: onevision_config)."""
    return AnyresLayout.from_config(multimodal, max_tiles(multimodal))


class LlavaOnevisionImageProcessor(LlavaNextImageProcessor):
    """LLaVA-NeXT's tiling under LlavaOnevisionImageProcessor's name and defaults (no center crop, 384 pixels)."""

    processor_type = "LlavaOnevisionImageProcessor"
    defaults = {**LlavaNextImageProcessor.defaults, "size": {"height": 384, "width": 384}, "do_center_crop": False,
                "crop_size": None, "image_grid_pinpoints": ONEVISION_PINPOINTS}


def _check_processor_fields(model_dir: str, config: Mapping[str, Any], layout: AnyresLayout) -> None:
    """processor_config.json's LlavaOnevisionProcessor fields, which set its placeholder counts: they must say
    what config.json does (ferrox counts by config.json), or the folder is refused by name."""
    path = os.path.join(model_dir, PROCESSOR_FILE)
    fields = read_json_object(path) if os.path.isfile(path) else {}
    want = {"num_image_tokens": layout.patches**2,
            "vision_feature_select_strategy": config["vision_feature_select_strategy"],
            "vision_aspect_ratio": config["vision_aspect_ratio"]}
    for name, value in want.items():
        if fields.get(name) is not None and fields[name] != value:
            raise UnsupportedModelError(f"{PROCESSOR_FILE}: {name} {fields[name]!r} differs from config.json's "
                                        f"{value!r}")


def llava_onevision_image_prompts(model_dir: str, hf_config: Mapping[str, Any], tokenizer: Any, *,
                                  limit: int | None, allowed_local_media_path: str | None,
                                  video_limit: int | None = None) -> LlavaNextImagePrompts:
    """The prompt rules of a LLaVA-OneVision folder (hf_config: config.json)."""
    config = onevision_config(hf_config)
    token_id = int(config["image_token_index"])
    if not isinstance(config["video_token_index"], int):
        raise ModelLoadError(f"config.json: video_token_index must be a token id, got {config['video_token_index']!r}")
    placeholder = tokenizer.id_to_token(token_id) if hasattr(tokenizer, "id_to_token") else None
    layout = onevision_layout(config)
    processor = None
    if os.path.isdir(model_dir):
        _check_processor_fields(model_dir, config, layout)
        processor = LlavaOnevisionImageProcessor.from_model_dir(model_dir, layout)
    prompts = LlavaNextImagePrompts(token_id, 0, placeholder or "<image>", processor, model_dir, limit,
                                    allowed_local_media_path)
    # (Set even when videos are refused: a `<video>` in a prompt is then refused by name, not run as text.)
    prompts.video_token_id = video_id = config["video_token_index"]
    video_pad = tokenizer.id_to_token(video_id) if hasattr(tokenizer, "id_to_token") else None
    try:
        video = (LlavaOnevisionVideoProcessor.from_model_dir(model_dir, layout.tile, layout.patches)
                 if os.path.isdir(model_dir) else None)
    except (UnsupportedModelError, ModelLoadError) as e:  # the folder's images are still taken
        prompts.video_refusal = f"LLaVA-OneVision takes no video inputs from this folder: {e}"
        return prompts
    if video_pad is None or video is None:
        prompts.video_refusal = "LLaVA-OneVision takes no video inputs from this folder: " + (
            f"config.json's video_token_index {video_id} is not in the tokenizer's vocabulary" if video_pad is None
            else f"model folder {model_dir} has no video processor config")
        return prompts
    prompts.video_processor, prompts.video_placeholder, prompts.video_limit = video, video_pad, video_limit
    return prompts
