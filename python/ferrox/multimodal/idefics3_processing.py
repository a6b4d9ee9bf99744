"""Idefics3 and SmolVLM images: their tiles' pixels and the prompt text each image becomes.

transformers' Idefics3ImageProcessor (the PIL one; SmolVLMImageProcessor is the same code), step for step:
RGB; resize so the longest edge is size.longest_edge (always, up or down: the other edge keeps the aspect
ratio, rounded down then up to even, the whole kept under 4096); with do_image_splitting, resize again
to whole tiles of max_image_size.longest_edge (M) a side and cut the image into rows x cols M-square
tiles in row-major order, then the whole image squashed to M x M as a last "global" tile (an image no
larger than M is one tile, rows = cols = 0); without splitting, only the squashed M x M image. PIL
resizes on uint8 (LANCZOS by default), rescale in float64 then float32, normalize in float32.

Idefics3Processor (SmolVLMProcessor the same) replaces each `<image>` of the text by

    rows = cols = 0:  <fake_token_around_image><global-img>{<image> x N}<fake_token_around_image>
    otherwise:        for each row: for each col: <fake_token_around_image><row_r_col_c>{<image> x N}
                      then "\\n"; then "\\n<fake_token_around_image><global-img>{<image> x N}<fake_token_around_image>"

with N = image_seq_len, each tile's rows after the vision tower and its pixel shuffle. The replacement
starts and ends with an added token, so the tokenizer, which splits text at added tokens, encodes it
apart from the prompt text around it: its ids are the encoded string, put where the `<image>` id was.
An image's tiles are not contiguous (row/col tokens sit between them), so each tile is one
MultiModalItem: a run of N image tokens and its [3, M, M] pixels (worker/multimodal.py takes them as
it takes any model's images). Front-end code: numpy and PIL only.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from PIL import Image

from ferrox.errors import UnsupportedModelError
from ferrox.multimodal.config_fields import (
    PREPROCESSOR_FILE,
    PROCESSOR_FILE,
    flag,
    image_processor_fields,
    read_json_object,
)
from ferrox.multimodal.image_processor import resample_filter, to_rgb
from ferrox.multimodal.inputs import MultiModalItem
from ferrox.multimodal.pixel_scaling import PixelScaling
from ferrox.multimodal.processing import ImagePrompts, token_runs

ARCHITECTURES = ("Idefics3ForConditionalGeneration", "SmolVLMForConditionalGeneration")
FAKE_TOKEN = "<fake_token_around_image>"
GLOBAL_TOKEN = "<global-img>"
DEFAULT_IMAGE_TOKEN_ID = 128_257  # Idefics3Config's and SmolVLMConfig's
MAX_IMAGE_SIZE = 4096  # transformers' cap on the resized image's longest edge

# Idefics3VisionConfig's defaults (SmolVLMVisionConfig's are the same) for the keys read here.
VISION_DEFAULTS = {"image_size": 224, "patch_size": 32}
# Idefics3ImageProcessor's class attributes: what a field means when the file leaves it out.
_PROCESSOR_DEFAULTS: dict[str, Any] = {
    "do_resize": True, "size": {"longest_edge": 4 * 364}, "resample": 1, "do_rescale": True,
    "rescale_factor": 1 / 255, "do_normalize": True, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
    "do_convert_rgb": True, "do_image_splitting": True, "max_image_size": {"longest_edge": 364}, "do_pad": True,
}
_PROCESSOR_TYPES = ("Idefics3ImageProcessor", "SmolVLMImageProcessor")


def idefics3_image_tokens(multimodal: Mapping[str, Any]) -> int:
    """Rows per tile: the tower's patches over scale_factor squared (the pixel shuffle merges
    scale x scale neighbours), as Idefics3Model.image_seq_len."""
    vision = {**VISION_DEFAULTS, **(multimodal.get("vision_config") or {})}
    side = int(vision["image_size"]) // int(vision["patch_size"])
    scale = int(multimodal.get("scale_factor", 2))
    if scale < 1 or side % scale:
        raise UnsupportedModelError(f"config.json: scale_factor {scale} must divide the tower's {side} patches a side",
                                    param="scale_factor")
    return (side // scale) ** 2


class Idefics3ImageProcessor:
    """`processor(image)` -> (float32 [tiles, 3, M, M], rows, cols) for one PIL image."""

    def __init__(self, config: Mapping[str, Any], where: str = PREPROCESSOR_FILE):
        kind = str(config.get("image_processor_type") or "")
        for suffix in ("Fast", "Pil"):
            kind = kind.removesuffix(suffix)
        if kind not in _PROCESSOR_TYPES:
            raise UnsupportedModelError(f"{where}: image_processor_type {config.get('image_processor_type')!r} is not "
                                        f"an Idefics3 one ({', '.join(_PROCESSOR_TYPES)})")
        fields = {**_PROCESSOR_DEFAULTS, **{k: v for k, v in config.items() if k in _PROCESSOR_DEFAULTS and v is not None}}
        self.where = where
        self.do_resize = flag(fields, "do_resize", where)
        size = fields["size"]
        if not isinstance(size, Mapping) or not (_positive(size.get("longest_edge")) or (
                _positive(size.get("height")) and _positive(size.get("width")))):
            raise UnsupportedModelError(f"{where}: size must be {{longest_edge}} or {{height, width}}, got {size!r}")
        self.size = dict(size)
        max_size = fields["max_image_size"]
        if not isinstance(max_size, Mapping) or not _positive(max_size.get("longest_edge")):
            raise UnsupportedModelError(f"{where}: max_image_size must be {{longest_edge: N}}, got {max_size!r}")
        self.tile = int(max_size["longest_edge"])
        self.resample = Image.Resampling(resample_filter(fields["resample"], where))
        self.scaling = PixelScaling.read(fields, where)
        self.do_image_splitting = flag(fields, "do_image_splitting", where)
        # do_convert_rgb: every image is made RGB (the tower takes three channels); do_pad pads a batch's
        # images to one tile count, the model dropping the padding tiles: nothing to do image by image.

    @classmethod
    def from_model_dir(cls, path: str | os.PathLike[str]) -> Idefics3ImageProcessor | None:
        """From preprocessor_config.json, else processor_config.json's image_processor (transformers 5
        saves only that); None when the folder has neither."""
        found = image_processor_fields(path)
        return cls(found[0], found[1]) if found is not None else None

    def __call__(self, image: Image.Image) -> tuple[np.ndarray, int, int]:
        image = to_rgb(image)
        if self.do_resize:
            if "longest_edge" in self.size:
                height, width = _longest_edge_size(image.height, image.width, int(self.size["longest_edge"]))
            else:
                height, width = int(self.size["height"]), int(self.size["width"])
            image = self._resize(image, height, width)
        rows = cols = 0
        if self.do_image_splitting:
            image = self._resize(image, *_whole_tiles_size(image.height, image.width, self.tile))
            if image.height > self.tile or image.width > self.tile:
                rows = (image.height - self.tile) // self.tile + 1
                cols = (image.width - self.tile) // self.tile + 1
                tiles = [image.crop((c * self.tile, r * self.tile, (c + 1) * self.tile, (r + 1) * self.tile))
                         for r in range(rows) for c in range(cols)]
                tiles.append(self._resize(image, self.tile, self.tile))
            else:
                tiles = [image]
        else:
            tiles = [self._resize(image, self.tile, self.tile)]
        return np.stack([self._pixels(t) for t in tiles]), rows, cols

    def _resize(self, image: Image.Image, height: int, width: int) -> Image.Image:
        return image.resize((width, height), resample=self.resample)

    def _pixels(self, tile: Image.Image) -> np.ndarray:
        """float32 CHW, as transformers' rescale and normalize compute it."""
        pixels: np.ndarray = np.asarray(tile)
        pixels = self.scaling.apply(pixels)
        return np.ascontiguousarray(pixels.transpose(2, 0, 1), dtype=np.float32)


def _longest_edge_size(height: int, width: int, longest: int) -> tuple[int, int]:
    """transformers' get_resize_output_image_size: the longest edge becomes `longest` (the other rounded
    down, then up to even), then both scaled under MAX_IMAGE_SIZE."""
    aspect = width / height
    if width >= height:
        width, height = longest, int(longest / aspect)
        height += height % 2
    else:
        height, width = longest, int(longest * aspect)
        width += width % 2
    height, width = max(height, 1), max(width, 1)
    aspect = width / height
    if width >= height and width > MAX_IMAGE_SIZE:
        width, height = MAX_IMAGE_SIZE, int(MAX_IMAGE_SIZE / aspect)
    elif height > width and height > MAX_IMAGE_SIZE:
        height, width = MAX_IMAGE_SIZE, int(MAX_IMAGE_SIZE * aspect)
    return max(height, 1), max(width, 1)


def _whole_tiles_size(height: int, width: int, tile: int) -> tuple[int, int]:
    """transformers' resize_for_vision_encoder: both edges up to whole tiles (the short one from the
    long one's new length over the aspect ratio, truncated, then rounded up)."""
    aspect = width / height
    if width >= height:
        width = math.ceil(width / tile) * tile
        height = math.ceil(int(width / aspect) / tile) * tile
    else:
        height = math.ceil(height / tile) * tile
        width = math.ceil(int(height * aspect) / tile) * tile
    return height, width


def image_prompt_text(rows: int, cols: int, image_seq_len: int, image_token: str) -> str:
    """What Idefics3Processor writes in place of one `<image>` (module docstring)."""
    tile = image_token * image_seq_len
    glob = f"{FAKE_TOKEN}{GLOBAL_TOKEN}{tile}{FAKE_TOKEN}"
    if rows == 0 and cols == 0:
        return glob
    grid = "".join("".join(f"{FAKE_TOKEN}<row_{r + 1}_col_{c + 1}>{tile}" for c in range(cols)) + "\n"
                   for r in range(rows))
    return f"{grid}\n{glob}"


@dataclass(slots=True)
class Idefics3ImagePrompts(ImagePrompts):
    """Idefics3 / SmolVLM prompt rules: one `<image>` token per image, replaced by its tiles' text
    (module docstring); one MultiModalItem per tile. A prompt already holding the expanded runs is
    refused: the tile count depends on the image, so the placeholder must be a single token."""

    tokenizer: Any = None
    _blocks: dict[tuple[int, int], list[int]] = field(default_factory=dict)

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
            tiles, rows, cols = self.process_item(processor, image, digest)
            block = self._block(rows, cols)
            for t, (offset, length) in enumerate(token_runs(block, self.image_token_id)):
                items.append(MultiModalItem.from_pixels(len(out) + offset, length, tiles[t], f"{digest}:{t}"))
            out.extend(block)
            at = start + 1
        out.extend(ids[at:])
        return out, items

    def _block(self, rows: int, cols: int) -> list[int]:
        """The ids of one image's replacement text (cached by grid)."""
        block = self._blocks.get((rows, cols))
        if block is None:
            text = image_prompt_text(rows, cols, self.tokens_per_image, self.placeholder)
            block = list(self.tokenizer.encode(text, add_special_tokens=False))
            runs = token_runs(block, self.image_token_id)
            if len(runs) != rows * cols + 1 or any(n != self.tokens_per_image for _, n in runs):
                raise UnsupportedModelError(f"the tokenizer does not encode {self.placeholder!r} as the image token "
                                            f"{self.image_token_id} one per placeholder")
            self._blocks[(rows, cols)] = block
        return block


def idefics3_image_prompts(model_dir: str, multimodal: Mapping[str, Any], tokenizer: Any, *, limit: int | None,
                           allowed_local_media_path: str | None) -> Idefics3ImagePrompts:
    """The prompt rules of an Idefics3 / SmolVLM folder (config.json's top level: `multimodal`)."""
    token_id = int(multimodal.get("image_token_id", DEFAULT_IMAGE_TOKEN_ID))
    placeholder = tokenizer.id_to_token(token_id)
    if placeholder is None:
        raise UnsupportedModelError(f"config.json: image_token_id {token_id} is not in the tokenizer's vocabulary")
    tokens = idefics3_image_tokens(multimodal)
    processor = None
    if os.path.isdir(model_dir):
        processor = Idefics3ImageProcessor.from_model_dir(model_dir)
        seq_len = read_json_object(os.path.join(model_dir, PROCESSOR_FILE)).get("image_seq_len")
        if seq_len is not None and seq_len != tokens:
            raise UnsupportedModelError(f"{PROCESSOR_FILE}: image_seq_len {seq_len} but the model's tiles give {tokens} "
                                        "rows each ((image_size / patch_size)^2 / scale_factor^2)")
    if processor is not None:
        size = int({**VISION_DEFAULTS, **(multimodal.get("vision_config") or {})}["image_size"])
        if processor.tile != size:
            raise UnsupportedModelError(f"{processor.where}: max_image_size.longest_edge {processor.tile} differs from "
                                        f"the vision tower's image_size {size}; ferrox takes tiles of the tower's size")
    return Idefics3ImagePrompts(token_id, tokens, placeholder, processor, model_dir, limit, allowed_local_media_path,
                                tokenizer)



def _positive(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0

