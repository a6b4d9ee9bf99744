"""InternVL images (InternVLForConditionalGeneration): their tiles' pixels and the prompt ids each image becomes.

transformers' GotOcr2ImageProcessor (the PIL one) as InternVLProcessor calls it, step for step: RGB; choose the
tile grid (cols x rows, min_patches <= cols * rows <= max_patches) whose aspect ratio is closest to the image's,
a tie going to the later, larger grid while the image's area exceeds half the grid's; resize the image with PIL
to whole tiles of size.height x size.width and cut them in row-major order; when that gives more than one tile,
add the whole image resized to one tile (the thumbnail) last. Rescale in float64 then float32, normalize in
float32. InternVLProcessor asks for these crops (its images default crop_to_patches=True) whatever the image
processor's own crop_to_patches says, so they are made here always; max_patches 1 gives the single resized tile.

InternVLProcessor replaces each `<IMG_CONTEXT>` of the text (the chat templates write one per image) by
`<img>` + `<IMG_CONTEXT>` x (tiles * image_seq_length) + `</img>`. All three are added tokens, which the
tokenizer splits text at, so the prompt's ids are the same with the single image token id replaced by those
ids. An image's tiles are contiguous, so each image is one MultiModalItem: its run of context tokens and its
[tiles, 3, S, S] pixels (models/internvl.py embeds the tiles together). Front-end code: numpy and PIL only.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from PIL import Image

from ferrox.errors import UnsupportedModelError
from ferrox.multimodal.config_fields import (
    PROCESSOR_FILE,
    flag,
    image_processor_fields,
    positive_int,
    read_json_object,
)
from ferrox.multimodal.image_processor import resample_filter, to_rgb
from ferrox.multimodal.inputs import MultiModalItem
from ferrox.multimodal.pixel_scaling import PixelScaling
from ferrox.multimodal.processing import ImagePrompts

# InternVLVisionConfig's tile geometry when vision_config leaves it out (models/vision/intern_vit.py's
# CONFIG_DEFAULTS take these: the prompt side needs them without importing the tower, or torch).
TOWER_GEOMETRY_DEFAULTS: dict[str, Any] = {"image_size": 448, "patch_size": 14}

DEFAULT_IMAGE_TOKEN_ID = 151_667  # InternVLConfig's
# The tokens InternVLProcessor reads off the tokenizer (tokenizer_config.json's extra_special_tokens), with the
# hub's spellings for a tokenizer that does not name them.
DEFAULT_MARKERS = {"start_image_token": "<img>", "end_image_token": "</img>"}

# GotOcr2ImageProcessor's class attributes: what a field means when the file leaves it out (or sets it null).
_CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
_CLIP_STD = [0.26862954, 0.26130258, 0.27577711]
_PROCESSOR_DEFAULTS: dict[str, Any] = {
    "do_resize": True, "size": {"height": 384, "width": 384}, "resample": 3, "do_rescale": True,
    "rescale_factor": 1 / 255, "do_normalize": True, "image_mean": _CLIP_MEAN, "image_std": _CLIP_STD,
    "do_convert_rgb": True, "crop_to_patches": False, "min_patches": 1, "max_patches": 12,
}
# Fields that would change the pixels if set, which GotOcr2ImageProcessor does not do: refused when set.
_REFUSED_FIELDS = ("do_center_crop", "do_pad")


def tiling_grid(height: int, width: int, tile: int, min_tiles: int, max_tiles: int) -> tuple[int, int]:
    """(cols, rows) of transformers' get_optimal_tiled_canvas for a square tile (the same float comparisons)."""
    grids = sorted(((w, h) for w in range(1, max_tiles + 1) for h in range(1, max_tiles + 1)
                    if min_tiles <= w * h <= max_tiles), key=lambda g: g[0] * g[1])
    return closest_grid(width, height, tile, grids)


def closest_grid(width: int, height: int, tile: int, grids: Sequence[tuple[int, int]]) -> tuple[int, int]:
    """The (cols, rows) of `grids` (in their order) whose aspect is nearest the image's; a tie goes to the later
    grid when the image covers more than half of it (InternVL's rule, in both its layouts)."""
    aspect, area = width / height, width * height
    best, best_diff = (1, 1), float("inf")
    for grid in grids:
        diff = abs(aspect - grid[0] / grid[1])
        if diff < best_diff:
            best, best_diff = grid, diff
        elif diff == best_diff and area > 0.5 * tile * tile * grid[0] * grid[1]:
            best = grid
    return best


class InternVLImageProcessor:
    """`processor(image)` -> float32 [tiles, 3, S, S] for one PIL image (module docstring)."""

    def __init__(self, config: Mapping[str, Any], where: str):
        kind = str(config.get("image_processor_type") or "")
        for suffix in ("Fast", "Pil"):
            kind = kind.removesuffix(suffix)
        if kind != "GotOcr2ImageProcessor":
            raise UnsupportedModelError(f"{where}: image_processor_type {config.get('image_processor_type')!r} is not "
                                        "InternVL's (GotOcr2ImageProcessor)")
        for name in _REFUSED_FIELDS:
            if config.get(name):
                raise UnsupportedModelError(f"{where}: {name} is set; InternVL's image processor does not do it")
        fields = {**_PROCESSOR_DEFAULTS, **{k: v for k, v in config.items() if k in _PROCESSOR_DEFAULTS and v is not None}}
        self.where = where
        if not flag(fields, "do_resize", where):
            raise UnsupportedModelError(f"{where}: do_resize is false; ferrox needs every tile at the tower's size")
        size = fields["size"]
        if not isinstance(size, Mapping) or set(size) != {"height", "width"} or size["height"] != size["width"]:
            raise UnsupportedModelError(f"{where}: size must be a square {{height, width}}, got {size!r}")
        self.tile = positive_int(size["height"], "size.height", where)
        self.resample = Image.Resampling(resample_filter(fields["resample"], where))
        self.scaling = PixelScaling.read(fields, where)
        self.min_patches = positive_int(fields["min_patches"], "min_patches", where)
        self.max_patches = positive_int(fields["max_patches"], "max_patches", where)
        # do_convert_rgb: every image is made RGB (the tower takes three channels).

    @classmethod
    def from_model_dir(cls, path: str | os.PathLike[str]) -> InternVLImageProcessor | None:
        found = image_processor_fields(path)
        return cls(found[0], found[1]) if found is not None else None

    def __call__(self, image: Image.Image) -> np.ndarray:
        image = to_rgb(image)
        s = self.tile
        if self.max_patches > 1:
            cols, rows = tiling_grid(image.height, image.width, s, self.min_patches, self.max_patches)
            canvas = image.resize((cols * s, rows * s), resample=self.resample)
            tiles = [canvas.crop((c * s, r * s, (c + 1) * s, (r + 1) * s)) for r in range(rows) for c in range(cols)]
            if len(tiles) > 1:
                tiles.append(image.resize((s, s), resample=self.resample))  # the thumbnail
        else:
            tiles = [image.resize((s, s), resample=self.resample)]
        return np.stack([self._pixels(t) for t in tiles])

    def _pixels(self, tile: Image.Image) -> np.ndarray:
        pixels = self.scaling.apply(np.asarray(tile))
        return np.ascontiguousarray(pixels.transpose(2, 0, 1), dtype=np.float32)


@dataclass(slots=True)
class InternVLImagePrompts(ImagePrompts):
    """InternVL prompt rules: one `<IMG_CONTEXT>` per image, replaced by `<img>`, its tiles' context tokens and
    `</img>`; one MultiModalItem per image over its context tokens. tokens_per_image is per tile. A prompt
    already holding expanded runs is refused: the tile count depends on the image."""

    start_id: int = 0
    end_id: int = 0

    def expand(self, prompt_ids: Sequence[int], images: Sequence[Any], what: str,
               param: str = "multi_modal_data") -> tuple[list[int], list[MultiModalItem]]:
        from ferrox.multimodal.media import image_hash

        ids, places = self.tile_placeholders(prompt_ids, images, what, param)
        if not images:
            return ids, []
        processor = self.processor_for(what, param)
        out: list[int] = []
        items: list[MultiModalItem] = []
        at = 0
        for start, image in zip(places, images, strict=True):
            out.extend(ids[at:start])
            digest = image_hash(image)
            tiles = self.process_item(processor, image, digest)
            length = len(tiles) * self.tokens_per_image
            out.append(self.start_id)
            items.append(MultiModalItem.from_pixels(len(out), length, tiles, digest))
            out.extend([self.image_token_id] * length)
            out.append(self.end_id)
            at = start + 1
        out.extend(ids[at:])
        return out, items


def internvl_tokens_per_tile(multimodal: Mapping[str, Any]) -> int:
    """Rows a tile gives: the tower's patches after the pixel shuffle by downsample_ratio (1 / ratio an integer
    dividing the patch grid's side), as transformers' get_image_features reshapes them."""
    vision = {**TOWER_GEOMETRY_DEFAULTS, **(multimodal.get("vision_config") or {})}
    image, patch = (v[0] if isinstance(v, (list, tuple)) else v for v in (vision["image_size"], vision["patch_size"]))
    side = int(image) // int(patch)
    scale = shuffle_scale(multimodal)
    if side % scale:
        raise UnsupportedModelError(f"config.json: 1 / downsample_ratio = {scale} must divide the tower's {side} "
                                    "patches a side", param="downsample_ratio")
    return (side // scale) ** 2


def shuffle_scale(multimodal: Mapping[str, Any]) -> int:
    """The pixel shuffle's merge factor: 1 / downsample_ratio, which must be a whole number."""
    ratio = multimodal.get("downsample_ratio", 0.5)
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or ratio <= 0 or ratio > 1 or (
            abs(1 / ratio - round(1 / ratio)) > 1e-9):
        raise UnsupportedModelError(f"config.json: downsample_ratio {ratio!r} is not supported (1 / ratio must be a "
                                    "whole number)", param="downsample_ratio")
    return round(1 / ratio)


def internvl_image_prompts(model_dir: str, multimodal: Mapping[str, Any], tokenizer: Any, *, limit: int | None,
                           allowed_local_media_path: str | None) -> InternVLImagePrompts:
    """The prompt rules of an InternVL folder (config.json's top level: `multimodal`)."""
    token_id = int(multimodal.get("image_token_id", DEFAULT_IMAGE_TOKEN_ID))
    placeholder = tokenizer.id_to_token(token_id)
    if placeholder is None:
        raise UnsupportedModelError(f"config.json: image_token_id {token_id} is not in the tokenizer's vocabulary")
    tokens = internvl_tokens_per_tile(multimodal)
    seq = multimodal.get("image_seq_length", tokens)
    if seq != tokens:
        raise UnsupportedModelError(f"config.json: image_seq_length {seq} but the model's tiles give {tokens} rows "
                                    "each ((image_size / patch_size)^2 * downsample_ratio^2)")
    markers = dict(DEFAULT_MARKERS)
    processor = None
    if os.path.isdir(model_dir):
        extra = read_json_object(os.path.join(model_dir, "tokenizer_config.json")).get("extra_special_tokens")
        if isinstance(extra, Mapping):
            markers.update({k: v for k, v in extra.items() if k in markers and isinstance(v, str)})
        seq = read_json_object(os.path.join(model_dir, PROCESSOR_FILE)).get("image_seq_length")
        if seq is not None and seq != tokens:
            raise UnsupportedModelError(f"{PROCESSOR_FILE}: image_seq_length {seq} but the model's tiles give {tokens} "
                                        "rows each")
        processor = InternVLImageProcessor.from_model_dir(model_dir)
    ids = {}
    for key, text in markers.items():
        found = tokenizer.token_to_id(text)
        if found is None:
            raise UnsupportedModelError(f"the tokenizer has no {text!r} ({key}), which InternVL's prompts put around "
                                        "each image")
        ids[key] = int(found)
    if processor is not None:
        size = {**TOWER_GEOMETRY_DEFAULTS, **(multimodal.get("vision_config") or {})}["image_size"]
        size = int(size[0] if isinstance(size, (list, tuple)) else size)
        if processor.tile != size:
            raise UnsupportedModelError(f"{processor.where}: size {processor.tile} differs from the vision tower's "
                                        f"image_size {size}; ferrox takes tiles of the tower's size")
    return InternVLImagePrompts(token_id, tokens, placeholder, processor, model_dir, limit, allowed_local_media_path,
                                ids["start_image_token"], ids["end_image_token"])
