"""InternVL's remote-code layout (InternVLChatModel: OpenGVLab/InternVL2.5-*, InternVL3-*, InternVL3.5-* without
"-HF"): its config read in InternVLForConditionalGeneration's terms, its tiles' pixels, and the prompt ids each
image becomes. The maths is models/internvl.py's; the differences are here.

These repos ship no preprocessor_config.json: the remote code's own dynamic_preprocess prepares an image, from
config.json's fields, and vLLM does the same:
  - tiles of force_image_size (or vision_config.image_size) pixels a side. With dynamic_image_size, the grid
    (cols x rows, min_dynamic_patch <= cols * rows <= max_dynamic_patch) whose aspect ratio is closest to the
    image's, a tie going to the later grid while the image's area exceeds half the grid's, the candidates
    ordered by tile count (find_closest_aspect_ratio); without it, one tile;
  - the image resized (PIL bicubic) to the grid, cut in row-major order; with use_thumbnail and more than one
    tile, the whole image resized to one tile last;
  - each tile to float32 / 255, then ImageNet's mean and std (torchvision's ToTensor and Normalize).
Images are made RGB first (media loading, as vLLM's does).

The prompt marks an image with the text `<image>` (vLLM's placeholder; the chat templates of these repos take
string content, which ferrox's chat rendering gives "<image>\\n" per image part). Each is replaced, in the text,
by `<img>` + `<IMG_CONTEXT>` x (tiles * num_image_token) + `</img>`, the three added tokens of the tokenizer,
which the tokenizer splits text at: so the ids are the prompt's with each `<image>` cut out of its text segment
and those ids put in its place. Front-end code: numpy and PIL only.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from PIL import Image

from ferrox.errors import InvalidArgumentError, ModelLoadError, UnsupportedModelError
from ferrox.multimodal.config_fields import positive_int
from ferrox.multimodal.image_processor import to_rgb
from ferrox.multimodal.inputs import MultiModalItem
from ferrox.multimodal.internvl_processing import closest_grid, internvl_tokens_per_tile
from ferrox.multimodal.pixel_scaling import rescale_normalize
from ferrox.multimodal.processing import ImagePrompts

WHERE = "config.json"
IMAGE_PLACEHOLDER = "<image>"
IMG_START, IMG_END, IMG_CONTEXT = "<img>", "</img>", "<IMG_CONTEXT>"
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)

# InternVLChatConfig's defaults for the keys read here (ps_version's is "v1", refused below).
CHAT_DEFAULTS: dict[str, Any] = {
    "select_layer": -1, "force_image_size": None, "downsample_ratio": 0.5, "dynamic_image_size": False,
    "use_thumbnail": False, "ps_version": "v1", "min_dynamic_patch": 1, "max_dynamic_patch": 6,
    "use_backbone_lora": 0, "use_llm_lora": 0,
}
# InternVisionConfig's defaults (InternViT-6B's), for a vision_config that leaves a key out.
VISION_DEFAULTS: dict[str, Any] = {
    "num_channels": 3, "patch_size": 14, "image_size": 224, "qkv_bias": False, "hidden_size": 3200,
    "num_attention_heads": 25, "intermediate_size": 12800, "qk_normalization": True, "num_hidden_layers": 48,
    "hidden_act": "gelu", "norm_type": "rms_norm", "layer_norm_eps": 1e-6,
}
# vision_config fields with no effect on inference, so nothing to honour: initializer_factor and
# initializer_range (initial values, the checkpoint's replace them), drop_path_rate, dropout and
# attention_dropout (training only), use_flash_attn (an attention kernel, the same maths).
# config.json's `template` names the conversation template of the remote code's own chat(); a server renders
# the tokenizer's chat_template instead (tokenizer_config.json), as vLLM does.


def chat_fields(multimodal: Mapping[str, Any]) -> dict[str, Any]:
    """config.json's top level over InternVLChatConfig's defaults, the settings ferrox does not reproduce
    refused by name."""
    cfg = {**CHAT_DEFAULTS, **{k: v for k, v in multimodal.items() if v is not None or k == "force_image_size"}}
    if cfg["ps_version"] != "v2":  # v1 orders the shuffled blocks column-major: earlier InternVL 1.x models
        raise UnsupportedModelError(f"{WHERE}: ps_version {cfg['ps_version']!r} is not supported (v2)",
                                    param="ps_version")
    for key in ("use_backbone_lora", "use_llm_lora"):  # the weights would be LoRA-wrapped
        if cfg[key]:
            raise UnsupportedModelError(f"{WHERE}: {key} {cfg[key]!r}: LoRA-wrapped InternVL checkpoints are not "
                                        "supported", param=key)
    if cfg.get("pad2square"):
        raise UnsupportedModelError(f"{WHERE}: pad2square is set; ferrox tiles images, it does not pad them",
                                    param="pad2square")
    return cfg


def vision_fields(multimodal: Mapping[str, Any]) -> dict[str, Any]:
    """vision_config over InternVisionConfig's defaults, its image_size checked against force_image_size."""
    given = multimodal.get("vision_config")
    if not isinstance(given, Mapping):
        raise ModelLoadError(f"{WHERE}: InternVLChatModel needs a vision_config object")
    vision = {**VISION_DEFAULTS, **{k: v for k, v in given.items() if v is not None}}
    forced = chat_fields(multimodal)["force_image_size"]
    if forced is not None and forced != vision["image_size"]:  # the remote code would resize the positions
        raise UnsupportedModelError(f"{WHERE}: force_image_size {forced!r} differs from vision_config.image_size "
                                    f"{vision['image_size']!r}; ferrox takes tiles of the tower's size",
                                    param="force_image_size")
    return vision


def native_multimodal(multimodal: Mapping[str, Any]) -> dict[str, Any]:
    """The remote config in InternVLForConditionalGeneration's terms (models/internvl.py, intern_vit.py)."""
    chat, vision = chat_fields(multimodal), vision_fields(multimodal)
    tower = {k: vision[k] for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                                    "hidden_act", "norm_type", "layer_norm_eps", "image_size", "patch_size",
                                    "num_channels")}
    tower.update(attention_bias=bool(vision["qkv_bias"]), use_qk_norm=bool(vision["qk_normalization"]),
                 qk_norm_eps=vision["layer_norm_eps"],  # the remote q/k RMSNorms take the tower's eps
                 use_mean_pooling=True)  # InternVisionModel has no final norm
    # mlp1 is LayerNorm, Linear, GELU (exact), Linear: the native projector with "gelu".
    return {"vision_config": tower, "vision_feature_layer": chat["select_layer"],
            "vision_feature_select_strategy": "default", "downsample_ratio": chat["downsample_ratio"],
            "projector_hidden_act": "gelu"}


def candidate_grids(min_tiles: int, max_tiles: int) -> list[tuple[int, int]]:
    """(cols, rows) of every grid min_tiles..max_tiles tiles, by tile count. The remote code sorts a set, so
    grids of one count keep the set's order (which decides an exact tie between, say, 1x2 and 2x1): built
    here the same way."""
    grids = {(i, j) for n in range(min_tiles, max_tiles + 1) for i in range(1, n + 1) for j in range(1, n + 1)
             if min_tiles <= i * j <= max_tiles}
    return sorted(grids, key=lambda g: g[0] * g[1])


class InternVLChatImageProcessor:
    """`processor(image)` -> float32 [tiles, 3, S, S] for one PIL image (module docstring)."""

    def __init__(self, multimodal: Mapping[str, Any]):
        chat, vision = chat_fields(multimodal), vision_fields(multimodal)
        self.tile = positive_int(vision["image_size"], "vision_config.image_size", WHERE)
        dynamic = chat["dynamic_image_size"]
        if not isinstance(dynamic, bool) or not isinstance(chat["use_thumbnail"], bool):
            raise ModelLoadError(f"{WHERE}: dynamic_image_size and use_thumbnail must be true or false")
        low = positive_int(chat["min_dynamic_patch"], "min_dynamic_patch", WHERE) if dynamic else 1
        high = positive_int(chat["max_dynamic_patch"], "max_dynamic_patch", WHERE) if dynamic else 1
        if low > high:
            raise ModelLoadError(f"{WHERE}: min_dynamic_patch {low} exceeds max_dynamic_patch {high}")
        self.grids = candidate_grids(low, high)
        self.use_thumbnail = chat["use_thumbnail"]
        self.mean_std = (np.array(IMAGENET_MEAN, np.float32), np.array(IMAGENET_STD, np.float32))

    def __call__(self, image: Image.Image) -> np.ndarray:
        image = to_rgb(image)
        s, bicubic = self.tile, Image.Resampling.BICUBIC
        cols, rows = closest_grid(image.width, image.height, s, self.grids)
        canvas = image.resize((cols * s, rows * s), resample=bicubic)
        tiles = [canvas.crop((c * s, r * s, (c + 1) * s, (r + 1) * s)) for r in range(rows) for c in range(cols)]
        if self.use_thumbnail and len(tiles) > 1:
            tiles.append(image.resize((s, s), resample=bicubic))
        return np.stack([self._pixels(t) for t in tiles])

    def _pixels(self, tile: Image.Image) -> np.ndarray:
        # float32(u8 / 255) either way: the float64 rescale rounds to the float32 quotient ToTensor makes.
        pixels = rescale_normalize(np.asarray(tile), 1 / 255, self.mean_std)
        return np.ascontiguousarray(pixels.transpose(2, 0, 1), dtype=np.float32)


@dataclass(slots=True)
class InternVLChatImagePrompts(ImagePrompts):
    """`<image>` in the prompt text, one per image, replaced by `<img>`, the image's tiles' context tokens and
    `</img>`; one MultiModalItem per image over its context tokens. tokens_per_image is per tile."""

    start_id: int = 0
    end_id: int = 0
    tokenizer: Any = None

    def expand(self, prompt_ids: Sequence[int], images: Sequence[Any], what: str,
               param: str = "multi_modal_data") -> tuple[list[int], list[MultiModalItem]]:
        from ferrox.multimodal.media import image_hash

        self.check_count(len(images), what, param)
        pieces = self._cut_placeholders(list(prompt_ids))
        if any(self.image_token_id in piece for piece in pieces):
            raise InvalidArgumentError(f"{what}: the prompt holds {IMG_CONTEXT} tokens itself; write "
                                       f"{IMAGE_PLACEHOLDER!r} where each image goes", param=param)
        self.check_placeholders(len(pieces) - 1, len(images), what, param, " (its tiles are expanded here)")
        processor = self.image_processor
        out: list[int] = list(pieces[0])
        items: list[MultiModalItem] = []
        for image, piece in zip(images, pieces[1:], strict=True):
            digest = image_hash(image)
            tiles = self.process_item(processor, image, digest)
            length = len(tiles) * self.tokens_per_image
            out.append(self.start_id)
            items.append(MultiModalItem.from_pixels(len(out), length, tiles, digest))
            out.extend([self.image_token_id] * length)
            out.append(self.end_id)
            out.extend(piece)
        return out, items

    def _cut_placeholders(self, ids: list[int]) -> list[list[int]]:
        """The ids between the `<image>` placeholders (one more piece than placeholders). A text segment (the
        ids between two added tokens) holding the text is decoded and its parts encoded again, as the tokenizer
        would encode the text with the image's tokens in place; a tokenizer with `<image>` as a token of its
        own has it as one id."""
        marker = self.tokenizer.token_to_id(IMAGE_PLACEHOLDER)
        added = set(self.tokenizer.backend.get_added_tokens_decoder())
        pieces: list[list[int]] = [[]]
        segment: list[int] = []

        def flush() -> None:
            text = self.tokenizer.decode(segment, skip_special_tokens=False) if segment else ""
            if IMAGE_PLACEHOLDER not in text:
                pieces[-1].extend(segment)
            else:
                for k, part in enumerate(text.split(IMAGE_PLACEHOLDER)):
                    if k:
                        pieces.append([])
                    pieces[-1].extend(self.tokenizer.encode(part, add_special_tokens=False) if part else [])
            segment.clear()

        for token in ids:
            if token in added or token == marker:
                flush()
                if token == marker:
                    pieces.append([])
                else:
                    pieces[-1].append(token)
            else:
                segment.append(token)
        flush()
        return pieces


def internvl_chat_tokens_per_tile(multimodal: Mapping[str, Any]) -> int:
    """num_image_token: (image_size / patch_size)^2 * downsample_ratio^2 rows a tile."""
    return internvl_tokens_per_tile(native_multimodal(multimodal))


def internvl_chat_image_prompts(model_dir: str, multimodal: Mapping[str, Any], tokenizer: Any, *,
                                limit: int | None, allowed_local_media_path: str | None) -> InternVLChatImagePrompts:
    """The prompt rules of an InternVLChatModel folder (config.json's top level: `multimodal`)."""
    ids = {}
    for text in (IMG_CONTEXT, IMG_START, IMG_END):
        found = tokenizer.token_to_id(text)
        if found is None:
            raise UnsupportedModelError(f"the tokenizer has no {text!r}, which InternVL's prompts put for each image")
        ids[text] = int(found)
    return InternVLChatImagePrompts(ids[IMG_CONTEXT], internvl_chat_tokens_per_tile(multimodal), IMAGE_PLACEHOLDER,
                                    InternVLChatImageProcessor(multimodal), model_dir, limit,
                                    allowed_local_media_path, ids[IMG_START], ids[IMG_END], tokenizer)
