"""Pixtral images (Mistral 3's: Mistral Small 3.1 / 3.2): their pixels and the tokens each image becomes.

transformers' PixtralImageProcessor (the PIL one, `PixtralImageProcessorPil` in transformers 5), for one image,
with PixtralProcessor's patch size (the tower's patch_size x spatial_merge_size: one unit per embedding row):
RGB; if a side is over size.longest_edge (or height / width) both shrink by the larger ratio, rounded down;
each side is then rounded up to whole units and PIL resizes to that (bicubic by default), even where nothing
changed; rescale in float64 then float32, normalize in float32; channels first. Each image keeps its own size
(transformers pads a batch to the largest, which the tower crops away again).

PixtralProcessor replaces each `[IMG]` of the text by the image's rows: cols x `[IMG]` then `[IMG_BREAK]`,
rows times, the last `[IMG_BREAK]` made `[IMG_END]` (rows, cols: the image's sides in units). One
MultiModalItem per image covers that whole layout; its embed_positions are the `[IMG]` positions (the
projector's rows go there, row-major) and its grid is [rows, cols]. A prompt may also hold an image's layout
already expanded: it must be exactly the one its image takes. Front-end code: numpy and PIL only.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from PIL import Image

from ferrox.errors import InvalidArgumentError, UnsupportedModelError
from ferrox.multimodal.config_fields import (
    PREPROCESSOR_FILE,
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

IMAGE_TOKEN, BREAK_TOKEN, END_TOKEN = "[IMG]", "[IMG_BREAK]", "[IMG_END]"
DEFAULT_IMAGE_TOKEN_ID = 10  # Mistral3Config's / LlavaConfig-for-Pixtral's image_token_index on the hub

# PixtralImageProcessor's class attributes: what a field means when the file leaves it out (or sets it null).
_PROCESSOR_DEFAULTS: dict[str, Any] = {
    "do_resize": True, "resample": 3, "size": {"longest_edge": 1024}, "do_rescale": True,
    "rescale_factor": 1 / 255, "do_normalize": True, "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711], "do_convert_rgb": True, "do_center_crop": False,
}
_PROCESSOR_TYPE = "PixtralImageProcessor"


class PixtralImageProcessor:
    """`processor(image)` -> (float32 [3, rows * unit, cols * unit] pixels, (rows, cols)) for one PIL image; unit:
    the pixels of one embedding row a side (the tower's patch_size x spatial_merge_size)."""

    def __init__(self, config: Mapping[str, Any], unit: int, where: str = PREPROCESSOR_FILE):
        kind = config.get("image_processor_type")
        if kind is not None and str(kind).removesuffix("Fast").removesuffix("Pil") != _PROCESSOR_TYPE:
            raise UnsupportedModelError(f"{where}: image_processor_type {kind!r} is not {_PROCESSOR_TYPE}")
        fields = {**_PROCESSOR_DEFAULTS,
                  **{k: v for k, v in config.items() if k in _PROCESSOR_DEFAULTS and v is not None}}
        self.where = where
        self.unit = unit
        self.max_height, self.max_width = _max_size(fields["size"], where)
        self.do_resize = flag(fields, "do_resize", where)
        self.resample = Image.Resampling(resample_filter(fields["resample"], where))
        if flag(fields, "do_center_crop", where):
            raise UnsupportedModelError(f"{where}: do_center_crop is true; ferrox does not crop Pixtral images")
        self.scaling = PixelScaling.read(fields, where)
        # do_convert_rgb: every image is made RGB (the tower takes three channels).

    @classmethod
    def from_model_dir(cls, path: str | os.PathLike[str], unit: int) -> PixtralImageProcessor | None:
        """From preprocessor_config.json, else processor_config.json's image_processor (transformers 5 saves
        only that); None when the folder has neither."""
        found = image_processor_fields(path)
        return cls(found[0], unit, found[1]) if found is not None else None

    def output_size(self, height: int, width: int) -> tuple[int, int]:
        """(height, width) after the resize: shrunk to fit the size, rounded down, then up to whole units."""
        ratio = max(height / self.max_height, width / self.max_width)
        if ratio > 1:
            height, width = math.floor(height / ratio), math.floor(width / ratio)
        if height < 1 or width < 1:
            raise ValueError(f"an image this long ({width}x{height} after fitting it into "
                             f"{self.max_width}x{self.max_height}) has a side of no pixels")
        u = self.unit
        return ((height - 1) // u + 1) * u, ((width - 1) // u + 1) * u

    def __call__(self, image: Image.Image) -> tuple[np.ndarray, tuple[int, int]]:
        """ValueError: an image too long to keep a pixel a side, or, without do_resize, one whose sides are not
        whole units."""
        image = to_rgb(image)
        if self.do_resize:
            height, width = self.output_size(image.height, image.width)
            image = image.resize((width, height), resample=self.resample)
        elif image.height % self.unit or image.width % self.unit:
            raise ValueError(f"a {image.width}x{image.height} image: without do_resize its sides must be multiples "
                             f"of {self.unit} (patch_size x spatial_merge_size)")
        pixels: np.ndarray = np.asarray(image)
        pixels = self.scaling.apply(pixels)
        chw = np.ascontiguousarray(pixels.transpose(2, 0, 1), dtype=np.float32)
        return chw, (image.height // self.unit, image.width // self.unit)


def layout_ids(rows: int, cols: int, image: int, brk: int, end: int) -> list[int]:
    """The tokens of an image of rows x cols embedding rows (module docstring)."""
    ids = ([image] * cols + [brk]) * rows
    ids[-1] = end
    return ids


@dataclass(slots=True)
class PixtralImagePrompts(ImagePrompts):
    """Pixtral's prompt rules: each `[IMG]` becomes its image's rows layout (module docstring); tokens_per_image
    is 0 (unused: it depends on the image)."""

    break_token_id: int = 0
    end_token_id: int = 0

    def expand(self, prompt_ids: Sequence[int], images: Sequence[Any], what: str,
               param: str = "multi_modal_data") -> tuple[list[int], list[MultiModalItem]]:
        from ferrox.multimodal.media import image_hash

        self.check_count(len(images), what, param)
        ids = list(prompt_ids)
        spans = self._spans(ids, what, param)
        self.check_placeholders(len(spans), len(images), what, param)
        if not images:
            return ids, []
        processor = self.processor_for(what, param)
        out: list[int] = []
        items: list[MultiModalItem] = []
        at = 0
        for k, ((start, length), image) in enumerate(zip(spans, images, strict=True)):
            digest = image_hash(image)
            try:
                pixels, (rows, cols) = self.process_item(processor, image, digest)
            except ValueError as e:
                raise InvalidArgumentError(f"{what}: image {k}: {e}", param=param) from None
            layout = layout_ids(rows, cols, self.image_token_id, self.break_token_id, self.end_token_id)
            if length > 1 and ids[start:start + length] != layout:
                raise InvalidArgumentError(f"{what}: image {k}'s expanded tokens are not the {rows}x{cols} layout its "
                                           f"image takes; put one {self.placeholder!r} where each image goes",
                                           param=param)
            out.extend(ids[at:start])
            where = [i for i, t in enumerate(layout) if t == self.image_token_id]
            items.append(MultiModalItem.from_pixels(len(out), len(layout), pixels, digest,
                                                    grid=[rows, cols], embed_positions=where))
            out.extend(layout)
            at = start + length
        out.extend(ids[at:])
        return out, items

    def _spans(self, ids: list[int], what: str, param: str) -> list[tuple[int, int]]:
        """(start, length) of each image's tokens: a lone `[IMG]` is a placeholder; `[IMG]`s and breaks up to an
        `[IMG_END]` are an image already expanded."""
        marks = {self.image_token_id, self.break_token_id, self.end_token_id}
        spans: list[tuple[int, int]] = []
        i = 0
        while i < len(ids):
            if ids[i] not in marks:
                i += 1
                continue
            j = i
            while j < len(ids) and ids[j] == self.image_token_id:
                j += 1
            if j < len(ids) and ids[j] in (self.break_token_id, self.end_token_id):
                while j < len(ids) and ids[j] in marks and ids[j] != self.end_token_id:
                    j += 1
                if j == len(ids) or ids[j] != self.end_token_id or ids[i] != self.image_token_id:
                    raise InvalidArgumentError(f"{what}: image break tokens outside an image's layout (an expanded "
                                               f"image runs {self.placeholder!r}s and breaks up to an end token)",
                                               param=param)
                spans.append((i, j + 1 - i))
                i = j + 1
            else:
                spans.extend((k, 1) for k in range(i, j))
                i = j
        return spans


def pixtral_image_prompts(model_dir: str, hf_config: Mapping[str, Any], tokenizer: Any, *, limit: int | None,
                          allowed_local_media_path: str | None, default_merge: int = 2) -> PixtralImagePrompts:
    """The prompt rules of a Mistral 3 folder or a LLaVA one over a Pixtral tower (hf_config: config.json). The
    unit an embedding row covers is the vision tower's patch_size x spatial_merge_size (default_merge where
    config.json does not say); a processor_config.json that says otherwise is refused."""
    token_id = int(hf_config.get("image_token_index", hf_config.get("image_token_id", DEFAULT_IMAGE_TOKEN_ID)))
    image = tokenizer.id_to_token(token_id)
    if image is None:
        raise UnsupportedModelError(f"config.json: image_token_index {token_id} is not in the tokenizer's vocabulary")
    extra = read_json_object(os.path.join(model_dir, PROCESSOR_FILE)) if os.path.isdir(model_dir) else {}
    found = []
    for key, default in (("image_break_token", BREAK_TOKEN), ("image_end_token", END_TOKEN)):
        name = str(extra.get(key) or default)
        found.append(tokenizer.token_to_id(name))
        if found[-1] is None:
            raise UnsupportedModelError(f"the tokenizer has no {name!r} token, which Pixtral's image layout needs")
    patch = int((hf_config.get("vision_config") or {}).get("patch_size", 14))
    merge = int(hf_config.get("spatial_merge_size", default_merge))
    for key, ours in (("patch_size", patch), ("spatial_merge_size", merge)):
        if extra.get(key) is not None and extra[key] != ours:
            raise UnsupportedModelError(f"{PROCESSOR_FILE}: {key} {extra[key]!r} differs from the model's {ours} "
                                        "(config.json)")
    processor = PixtralImageProcessor.from_model_dir(model_dir, patch * merge) if os.path.isdir(model_dir) else None
    return PixtralImagePrompts(token_id, 0, image, processor, model_dir, limit, allowed_local_media_path,
                               int(found[0]), int(found[1]))


def _max_size(size: Any, where: str) -> tuple[int, int]:
    if isinstance(size, Mapping) and size.get("longest_edge"):
        edge = positive_int(size["longest_edge"], "size.longest_edge", where)
        return edge, edge
    if isinstance(size, Mapping) and size.get("height") and size.get("width"):
        return positive_int(size["height"], "size.height", where), positive_int(size["width"], "size.width", where)
    raise UnsupportedModelError(f"{where}: size must be {{longest_edge}} or {{height, width}}, got {size!r}")

