"""LLaVA-NeXT images ("anyres"): their tiles and the tokens each image becomes.

transformers' LlavaNextImageProcessor (the PIL one, `LlavaNextImageProcessorPil` in transformers 5), for one
image of H x W: RGB; select_best_resolution picks the grid pinpoint (bh, bw) that keeps the most of the
image's pixels, then the least padding; PIL resizes the image to fit it (aspect kept, the short side rounded
up) and it is centred on zeros to bh x bw, then cut into tile x tile pieces row-major (tile: crop_size). The
tiles come after the base image, the whole image resized (squashed) to size x size. Each of those is then
resized, center-cropped, rescaled (float64, then float32) and normalized (float32) like a CLIP image:
[1 + (bh / tile) * (bw / tile), 3, tile, tile] pixels.

The model (models/llava_next.py) lays the grid tiles' feature rows out as one (bh / tile * p) x (bw / tile * p)
map (p = the tower's patches a side), crops the zero padding's rows or columns away (unpad), ends each map row
with `image_newline`, and puts the base tile's p * p rows first. LlavaNextProcessor expands each `<image>` to
that many tokens: a number that depends on the image's size (`image_tokens`). One MultiModalItem per image
carries its tiles and grid [H, W], from which the model rebuilds the layout. Front-end code: numpy and PIL only.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from PIL import Image

from ferrox.errors import ModelLoadError, UnsupportedModelError
from ferrox.multimodal.config_fields import (
    PREPROCESSOR_FILE,
    flag,
    image_processor_fields,
)
from ferrox.multimodal.image_processor import (
    center_crop,
    resample_filter,
    size_dict,
    to_rgb,
)
from ferrox.multimodal.pixel_scaling import PixelScaling
from ferrox.multimodal.processing import llava_image_tokens, llava_vision_config
from ferrox.multimodal.qwen2_vl_processing import QwenVLImagePrompts

# LlavaNextConfig's and LlavaNextImageProcessor's default pinpoints, (height, width).
DEFAULT_PINPOINTS = [[336, 672], [672, 336], [672, 672], [1008, 336], [336, 1008]]
_CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
_CLIP_STD = [0.26862954, 0.26130258, 0.27577711]
# LlavaNextImageProcessor's class attributes: what a field means when the file leaves it out (or sets it null).
_PROCESSOR_DEFAULTS: dict[str, Any] = {
    "do_resize": True, "size": {"shortest_edge": 224}, "resample": 3, "do_center_crop": True,
    "crop_size": {"height": 224, "width": 224}, "do_rescale": True, "rescale_factor": 1 / 255,
    "do_normalize": True, "image_mean": _CLIP_MEAN, "image_std": _CLIP_STD, "do_convert_rgb": True,
    "do_pad": True, "image_grid_pinpoints": DEFAULT_PINPOINTS,
}


def select_best_resolution(height: int, width: int, pinpoints: Sequence[Sequence[int]]) -> tuple[int, int]:
    """transformers' select_best_resolution: the (height, width) pinpoint that keeps the most of the image's
    pixels when it is scaled to fit, the least wasted area on a tie (the first of equals)."""
    best = (0, 0)
    most_kept, least_wasted = 0, float("inf")
    for h, w in pinpoints:
        scale = min(w / width, h / height)
        kept = min(int(width * scale) * int(height * scale), width * height)
        wasted = w * h - kept
        if kept > most_kept or (kept == most_kept and wasted < least_wasted):
            most_kept, least_wasted, best = kept, wasted, (h, w)
    return best


def unpadded_grid(height: int, width: int, rows: int, cols: int) -> tuple[int, int, int, int]:
    """(top, bottom, left, right) feature rows / columns of a rows x cols feature map that hold the image (of
    height x width) once the zero padding is cropped: transformers' unpad_image, with its rounding."""
    if width / height > cols / rows:
        new = int(round(height * (cols / width), 7))
        pad = (rows - new) // 2
        return pad, rows - pad, 0, cols
    new = int(round(width * (rows / height), 7))
    pad = (cols - new) // 2
    return 0, rows, pad, cols - pad


def parse_pinpoints(value: Any, tile: int, where: str) -> list[list[int]]:
    """image_grid_pinpoints: [height, width] pairs, each a whole number of tiles (the model's grid)."""
    if not isinstance(value, (list, tuple)) or not value:
        raise ModelLoadError(f"{where}: image_grid_pinpoints must be a list of [height, width], got {value!r}")
    out: list[list[int]] = []
    for pair in value:
        if (not isinstance(pair, (list, tuple)) or len(pair) != 2
                or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in pair)):
            raise ModelLoadError(f"{where}: image_grid_pinpoints must be [height, width] pairs, got {pair!r}")
        if pair[0] % tile or pair[1] % tile:
            raise UnsupportedModelError(f"{where}: image_grid_pinpoints {list(pair)} is not a whole number of the "
                                        f"{tile}-pixel tiles")
        out.append([int(pair[0]), int(pair[1])])
    return out


@dataclass(frozen=True, slots=True)
class AnyresLayout:
    """The geometry one model's images follow: tile pixels a side, tower patches a tile side (p), pinpoints."""

    tile: int
    patches: int
    pinpoints: list[list[int]]
    # LLaVA-OneVision's "anyres_max_N": an unpadded map of more than about N tiles' rows is scaled down (scaled).
    max_tiles: int | None = None

    @classmethod
    def from_config(cls, multimodal: Mapping[str, Any], max_tiles: int | None = None) -> AnyresLayout:
        """From config.json (its top level: multimodal); refuses a tower whose rows are not a p x p map (a CLIP
        tower under the "full" strategy keeps its class token, which transformers cannot lay out either)."""
        vision = llava_vision_config(multimodal)
        tile = int(vision.get("image_size", 336))
        patches = tile // int(vision.get("patch_size", 14))
        rows = llava_image_tokens(multimodal)
        if rows != patches * patches:
            raise UnsupportedModelError(f"config.json: the vision tower gives {rows} rows a tile, not a "
                                        f"{patches}x{patches} map (vision_feature_select_strategy "
                                        f"{multimodal.get('vision_feature_select_strategy', 'default')!r})")
        pinpoints = parse_pinpoints(multimodal.get("image_grid_pinpoints", DEFAULT_PINPOINTS), tile, "config.json")
        return cls(tile, patches, pinpoints, max_tiles)

    def grid(self, height: int, width: int) -> tuple[int, int]:
        """(rows, cols) of tiles an image of height x width is cut into, besides the base one."""
        h, w = select_best_resolution(height, width, self.pinpoints)
        return h // self.tile, w // self.tile

    def scaled(self, rows: int, cols: int) -> tuple[int, int]:
        """The (rows, cols) an unpadded feature map is resized to (bilinearly): itself, unless max_tiles is set
        and the map is more than 1.1x (per side) the rows of max_tiles tiles, when both sides are divided by
        that ratio and floored (transformers' LlavaOnevisionModel.pack_image_features)."""
        if self.max_tiles is None:
            return rows, cols
        ratio = math.sqrt(rows * cols / (self.max_tiles * self.patches**2))
        return (int(rows // ratio), int(cols // ratio)) if ratio > 1.1 else (rows, cols)

    def image_tokens(self, height: int, width: int) -> int:
        """Embedding rows of an image: its unpadded (maybe scaled) feature map, a newline per map row, the base
        tile."""
        rows, cols = self.grid(height, width)
        top, bottom, left, right = unpadded_grid(height, width, rows * self.patches, cols * self.patches)
        h, w = self.scaled(bottom - top, right - left)
        return h * (w + 1) + self.patches**2


class LlavaNextImageProcessor:
    """`processor(image)` -> (float32 [1 + tiles, 3, S, S] pixels, (height, width) of the image) for one PIL
    image (module docstring). A subclass names another processor class with other defaults (OneVision's)."""

    processor_type = "LlavaNextImageProcessor"
    defaults = _PROCESSOR_DEFAULTS

    def __init__(self, config: Mapping[str, Any], layout: AnyresLayout, where: str = PREPROCESSOR_FILE):
        kind = config.get("image_processor_type")
        if kind is not None and str(kind).removesuffix("Fast").removesuffix("Pil") != self.processor_type:
            raise UnsupportedModelError(f"{where}: image_processor_type {kind!r} is not {self.processor_type}")
        fields = {**self.defaults,
                  **{k: v for k, v in config.items() if k in self.defaults and v is not None}}
        self.where = where
        self.do_resize = flag(fields, "do_resize", where)
        self.size = size_dict(fields["size"], "size", square=False)
        self.resample = Image.Resampling(resample_filter(fields["resample"], where))
        self.do_center_crop = flag(fields, "do_center_crop", where)
        crop = fields["crop_size"]
        if crop is None:  # OneVision's default (no center crop): tiles are cut at size's side
            side = self.size.get("height", self.size.get("shortest_edge"))
            crop = {"height": side, "width": self.size.get("width", side)}
        self.crop_size = size_dict(crop, "crop_size")
        self.scaling = PixelScaling.read(fields, where)
        # do_convert_rgb: every image is made RGB (the tower takes three channels). do_pad pads a batch's images
        # to one tile count: each image here is its own item.
        base = self.size.get("shortest_edge")
        self.base_size = (base, base) if base is not None else (self.size["height"], self.size["width"])
        self.tile = self.crop_size["height"]  # transformers' patch size: crop_size's height (else size's)
        self.output_tile = self._output_tile()
        self.pinpoints = parse_pinpoints(fields["image_grid_pinpoints"], self.tile, where)
        self.layout = layout
        if self.tile != layout.tile or self.output_tile != layout.tile:
            raise UnsupportedModelError(f"{where}: tiles of {self.tile} pixels resized to {self.output_tile}, the "
                                        f"vision tower takes {layout.tile} (config.json)")
        if self.pinpoints != layout.pinpoints:
            raise UnsupportedModelError(f"{where}: image_grid_pinpoints {self.pinpoints} differ from config.json's "
                                        f"{layout.pinpoints}")

    @classmethod
    def from_model_dir(cls, path: str | os.PathLike[str], layout: AnyresLayout) -> LlavaNextImageProcessor | None:
        """From preprocessor_config.json, else processor_config.json's image_processor; None when the folder has
        neither. `layout`: the model's (config.json), which the processor must cut tiles for."""
        found = image_processor_fields(path)
        return cls(found[0], layout, found[1]) if found is not None else None

    def _output_tile(self) -> int:
        """The side of every tile this processor returns; a config that would give tiles of other shapes (the
        tower takes squares of its image size) is refused."""
        if self.do_center_crop:
            side = (self.crop_size["height"], self.crop_size["width"])
        elif not self.do_resize:
            side = (self.tile, self.tile) if self.base_size == (self.tile, self.tile) else (0, 1)
        elif "shortest_edge" in self.size:
            side = (self.size["shortest_edge"],) * 2
        else:
            side = (self.size["height"], self.size["width"])
        if side[0] != side[1] or self.crop_size["height"] != self.crop_size["width"]:
            raise UnsupportedModelError(f"{self.where}: size {self.size}, crop_size {self.crop_size}: ferrox takes "
                                        f"{self.processor_type}s whose tiles are squares of one size")
        return side[0]

    def tokens(self, size: tuple[int, int]) -> int:
        """The placeholder tokens of an image of size (height, width)."""
        return self.layout.image_tokens(*size)

    def __call__(self, image: Image.Image) -> tuple[np.ndarray, tuple[int, int]]:
        image = to_rgb(image)
        height, width = image.height, image.width
        best_h, best_w = select_best_resolution(height, width, self.pinpoints)
        # get_patch_output_size: fit inside the pinpoint, the other side rounded up.
        scale_w, scale_h = best_w / width, best_h / height
        if scale_w < scale_h:
            new_w, new_h = best_w, min(math.ceil(height * scale_w), best_h)
        else:
            new_h, new_w = best_h, min(math.ceil(width * scale_h), best_w)
        fitted = np.asarray(image.resize((new_w, new_h), resample=self.resample))
        top, left = (best_h - fitted.shape[0]) // 2, (best_w - fitted.shape[1]) // 2
        canvas = np.zeros((best_h, best_w, 3), dtype=np.uint8)
        canvas[top:top + fitted.shape[0], left:left + fitted.shape[1]] = fitted
        t = self.tile
        pieces = [np.asarray(image.resize((self.base_size[1], self.base_size[0]), resample=self.resample))]
        pieces += [canvas[i:i + t, j:j + t] for i in range(0, best_h, t) for j in range(0, best_w, t)]
        tiles = np.stack([self._finish(piece) for piece in pieces]).transpose(0, 3, 1, 2)
        return np.ascontiguousarray(tiles, dtype=np.float32), (height, width)

    def _finish(self, pixels: np.ndarray) -> np.ndarray:
        """One tile (uint8 HWC) by the CLIP steps: resize, center crop, rescale, normalize."""
        if self.do_resize:
            piece = Image.fromarray(pixels)
            if "shortest_edge" in self.size:
                short, long = sorted((piece.height, piece.width))
                edge = self.size["shortest_edge"]
                new_short, new_long = edge, int(edge * long / short)
                height, width = (new_long, new_short) if piece.width <= piece.height else (new_short, new_long)
            else:
                height, width = self.size["height"], self.size["width"]
            pixels = np.asarray(piece.resize((width, height), resample=self.resample))
        if self.do_center_crop:
            pixels = center_crop(pixels, self.crop_size["height"], self.crop_size["width"])
        pixels = self.scaling.apply(pixels)
        return pixels


@dataclass(slots=True)
class LlavaNextImagePrompts(QwenVLImagePrompts):
    """LLaVA-NeXT prompt rules: each `<image>` becomes its image's tokens (a number that depends on the image's
    size; tokens_per_image is 0: unused). Placeholder runs are read as Qwen2-VL's are (one token per image, or
    one image already expanded), so its expand serves: the processor gives (tiles, (height, width)) and
    `tokens((height, width))` the run's length, by the model's layout."""


def llava_next_image_prompts(model_dir: str, hf_config: Mapping[str, Any], tokenizer: Any, *, limit: int | None,
                             allowed_local_media_path: str | None) -> LlavaNextImagePrompts:
    """The prompt rules of a LLaVA-NeXT folder (hf_config: config.json)."""
    token_id = int(hf_config.get("image_token_index", hf_config.get("image_token_id", 32_000)))
    placeholder = tokenizer.id_to_token(token_id) if hasattr(tokenizer, "id_to_token") else None
    layout = AnyresLayout.from_config(hf_config)
    processor = LlavaNextImageProcessor.from_model_dir(model_dir, layout) if os.path.isdir(model_dir) else None
    return LlavaNextImagePrompts(token_id, 0, placeholder or "<image>", processor, model_dir, limit,
                                 allowed_local_media_path)
