"""Pixels the vision tower takes: a model's preprocessor_config.json applied to PIL images.

The numbers must be the ones the model was trained on, so this reproduces transformers' PIL image
processors (the "slow" ones; `...ImageProcessorPil` from transformers 5) step for step, with the same
rounding: RGB (transparency composited onto white), [Llava: pad to a square in the mean colour],
resize with PIL, center crop, rescale in float64 then float32, normalize in float32.

    CLIPImageProcessor    llava-1.5: shortest edge to size.shortest_edge, center crop to crop_size
    LlavaImageProcessor   CLIP, plus do_pad: pad to a square before resizing
    SiglipImageProcessor  resize to size.height x size.width exactly
    Gemma3ImageProcessor  Siglip's steps (bilinear by default); pan-and-scan crops are refused

A type saved with transformers' `Fast` or `Pil` suffix gets the same PIL arithmetic. Every image of a
call ends at `output_size`: ferrox refuses configs whose output size depends on the input.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from PIL import Image

from ferrox.errors import ModelLoadError, UnsupportedModelError
from ferrox.multimodal.config_fields import flag, read_json_object
from ferrox.multimodal.pixel_scaling import PixelScaling

CONFIG_FILE = "preprocessor_config.json"

_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
_HALF = (0.5, 0.5, 0.5)
_PIL_FILTERS = {0: "nearest", 1: "lanczos", 2: "bilinear", 3: "bicubic", 4: "box", 5: "hamming"}

# transformers' class attributes: what a field means when the file leaves it out (or sets it null).
_CLIP = {"resample": 3, "image_mean": _CLIP_MEAN, "image_std": _CLIP_STD, "size": {"shortest_edge": 224},
         "default_to_square": False, "crop_size": {"height": 224, "width": 224}, "do_center_crop": True}
DEFAULTS: dict[str, dict[str, Any]] = {
    "CLIPImageProcessor": _CLIP,
    "LlavaImageProcessor": {**_CLIP, "do_pad": False},
    "SiglipImageProcessor": {"resample": 3, "image_mean": _HALF, "image_std": _HALF,
                             "size": {"height": 224, "width": 224}, "default_to_square": False},
    "Gemma3ImageProcessor": {"resample": 2, "image_mean": _HALF, "image_std": _HALF,
                             "size": {"height": 224, "width": 224}, "default_to_square": True},
}
_COMMON = {"do_resize": True, "do_center_crop": False, "crop_size": None, "do_rescale": True,
           "rescale_factor": 1 / 255, "do_normalize": True, "do_convert_rgb": True, "do_pad": False}


class ImageProcessor:
    """One model's image preprocessing; `processor(images)` is the `pixel_values` batch."""

    def __init__(self, config: Mapping[str, Any]):
        self.kind = _processor_type(config)
        if self.kind == "Gemma3ImageProcessor" and config.get("do_pan_and_scan"):
            raise UnsupportedModelError(f"{CONFIG_FILE}: do_pan_and_scan is true; ferrox does not do Gemma 3's "
                                        "pan-and-scan crops (set it to false)")
        fields: dict[str, Any] = {**_COMMON, **DEFAULTS[self.kind]}
        fields.update({k: v for k, v in config.items() if k in fields and v is not None})

        self.do_resize = flag(fields, "do_resize", CONFIG_FILE)
        self.size = size_dict(fields["size"], "size", square=flag(fields, "default_to_square", CONFIG_FILE))
        self.resample = resample_filter(fields["resample"])
        self.do_center_crop = flag(fields, "do_center_crop", CONFIG_FILE)
        self.crop_size = None if fields["crop_size"] is None else size_dict(fields["crop_size"], "crop_size")
        self.scaling = PixelScaling.read(fields, CONFIG_FILE)
        # Read for completeness: an image that is not RGB is converted either way, since the vision
        # tower takes three channels (vLLM converts at load time); transformers would fail on it.
        self.do_convert_rgb = flag(fields, "do_convert_rgb", CONFIG_FILE)
        # Only Llava pads to a square; the others' do_pad pads a batch to its largest image, nothing
        # to do when every image ends at one size.
        self.pad_to_square = self.kind == "LlavaImageProcessor" and flag(fields, "do_pad", CONFIG_FILE)
        self._output_size = self._fixed_output_size()

    @classmethod
    def from_model_dir(cls, path: str | os.PathLike[str]) -> ImageProcessor | None:
        """The processor of a model folder's preprocessor_config.json; None when it has none."""
        file = os.path.join(path, CONFIG_FILE)
        return cls(read_json_object(file)) if os.path.isfile(file) else None

    @property
    def output_size(self) -> tuple[int, int]:
        """(height, width) of every image this processor returns."""
        return self._output_size

    def __call__(self, images: Sequence[Image.Image]) -> np.ndarray:
        """float32 [B, 3, H, W] pixel values, in the order given (numpy: the API server process, which
        prepares images, never imports torch; the engine core turns them into tensors)."""
        arrays = [self._one(image) for image in images]
        if not arrays:
            return np.empty((0, 3, *self._output_size), dtype=np.float32)
        batch = np.stack(arrays).transpose(0, 3, 1, 2)  # NHWC -> NCHW
        return np.ascontiguousarray(batch, dtype=np.float32)

    def one(self, image: Image.Image) -> np.ndarray:
        """float32 [3, H, W]: one image's row of the batch (each image is prepared on its own, so a prompt's
        images are processed, and cached, one by one)."""
        return self([image])[0]

    def _one(self, image: Image.Image) -> np.ndarray:
        """One image as float32 HWC, by transformers' steps in transformers' order."""
        image = to_rgb(image)
        if self.pad_to_square:
            image = _pad_to_square(image, tuple(int(m * 255) for m in self.scaling.image_mean))
        if self.do_resize:
            height, width = self._resized_size(image.height, image.width)
            image = image.resize((width, height), resample=Image.Resampling(self.resample))
        pixels: np.ndarray = np.asarray(image)
        if self.do_center_crop:
            assert self.crop_size is not None  # _fixed_output_size refused a crop without one
            pixels = center_crop(pixels, self.crop_size["height"], self.crop_size["width"])
        return self.scaling.apply(pixels)

    def _resized_size(self, height: int, width: int) -> tuple[int, int]:
        """transformers' get_resize_output_image_size(default_to_square=False) for shortest_edge:
        the short side becomes the size, the long side int(size * long / short), truncated."""
        if "shortest_edge" not in self.size:
            return self.size["height"], self.size["width"]
        short, long = sorted((height, width))
        new_short, new_long = self.size["shortest_edge"], int(self.size["shortest_edge"] * long / short)
        return (new_long, new_short) if width <= height else (new_short, new_long)

    def _fixed_output_size(self) -> tuple[int, int]:
        if self.do_center_crop:
            if self.crop_size is None:
                raise ModelLoadError(f"{CONFIG_FILE}: do_center_crop is true but crop_size is missing")
            return self.crop_size["height"], self.crop_size["width"]
        if self.do_resize and "height" in self.size:
            return self.size["height"], self.size["width"]
        raise UnsupportedModelError(
            f"{CONFIG_FILE}: without a center crop, size must give height and width (got {dict(self.size)}"
            f"{'' if self.do_resize else ' and do_resize false'}): ferrox needs one output size for every image")

    def __repr__(self) -> str:
        return (f"ImageProcessor({self.kind}, output_size={self.output_size}, "
                f"resample={_PIL_FILTERS[self.resample]})")


def to_rgb(image: Image.Image) -> Image.Image:
    """RGB, with any transparency composited onto white (transformers' convert_to_rgb; vLLM's too).
    An RGB PNG can carry a transparent colour key (info["transparency"]): those pixels turn white."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return image if image.mode == "RGB" else image.convert("RGB")


def _pad_to_square(image: Image.Image, colour: tuple[int, ...]) -> Image.Image:
    """The image centred on a square of its longer side, the rest filled with `colour` (offset
    rounded down, as transformers' pad_to_square)."""
    width, height = image.size
    if width == height:
        return image
    side = max(width, height)
    square = Image.new("RGB", (side, side), colour)
    square.paste(image, ((side - width) // 2, (side - height) // 2))
    return square


def center_crop(pixels: np.ndarray, crop_height: int, crop_width: int) -> np.ndarray:
    """transformers' center_crop on HWC: offsets (size - crop) // 2; an image smaller than the crop
    is first centred on zeros (offset rounded up) so the result is always crop-sized."""
    height, width = pixels.shape[:2]
    top, left = (height - crop_height) // 2, (width - crop_width) // 2
    if top >= 0 and left >= 0:
        return pixels[top:top + crop_height, left:left + crop_width]
    new_height, new_width = max(crop_height, height), max(crop_width, width)
    pad_top, pad_left = math.ceil((new_height - height) / 2), math.ceil((new_width - width) / 2)
    padded = np.zeros((new_height, new_width, *pixels.shape[2:]), dtype=pixels.dtype)
    padded[pad_top:pad_top + height, pad_left:pad_left + width] = pixels
    top, left = top + pad_top, left + pad_left
    return padded[max(0, top):top + crop_height, max(0, left):left + crop_width]


def _processor_type(config: Mapping[str, Any]) -> str:
    name = config.get("image_processor_type") or config.get("feature_extractor_type")
    if not isinstance(name, str):
        raise UnsupportedModelError(f"{CONFIG_FILE} has no image_processor_type")
    kind = name.replace("FeatureExtractor", "ImageProcessor")  # pre-2022 files (transformers does the same)
    for suffix in ("Fast", "Pil"):
        kind = kind.removesuffix(suffix)
    if kind not in DEFAULTS:
        raise UnsupportedModelError(f"{CONFIG_FILE}: image_processor_type {name!r} is not supported "
                                    f"(ferrox knows {', '.join(DEFAULTS)})")
    return kind


def size_dict(value: Any, field: str, square: bool = True) -> dict[str, int]:
    """transformers' get_size_dict: an int is a square (or, with default_to_square false, the
    shortest edge), a pair is (height, width), a dict is kept; ferrox takes the fixed-size forms."""
    if isinstance(value, int) and not isinstance(value, bool):
        value = {"height": value, "width": value} if square else {"shortest_edge": value}
    elif isinstance(value, (list, tuple)) and len(value) == 2:
        value = {"height": value[0], "width": value[1]}
    if not isinstance(value, Mapping) or set(value) not in ({"height", "width"}, {"shortest_edge"}):
        raise UnsupportedModelError(f"{CONFIG_FILE}: {field} must be {{height, width}} or {{shortest_edge}}, "
                                    f"got {value!r}")
    for key, side in value.items():
        if isinstance(side, bool) or not isinstance(side, int) or side <= 0:
            raise ModelLoadError(f"{CONFIG_FILE}: {field}.{key} must be a positive integer, got {side!r}")
    return dict(value)


def resample_filter(value: Any, where: str = CONFIG_FILE) -> int:
    """A processor config's `resample`: a PIL filter number (0-5), or ModelLoadError naming the file."""
    if isinstance(value, bool) or value not in _PIL_FILTERS:
        raise ModelLoadError(f"{where}: resample must be a PIL filter number 0-5, got {value!r}")
    return int(value)


