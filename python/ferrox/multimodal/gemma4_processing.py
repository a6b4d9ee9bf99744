"""Gemma 4 images: their patches and the tokens each image becomes.

transformers' Gemma4ImageProcessor (the PIL one, `Gemma4ImageProcessorPil`), for one image: RGB; the size kept
in its aspect ratio and fitted to the patch budget (get_aspect_ratio_preserving_size: at most
max_soft_tokens * pooling_kernel_size^2 patches of patch_size pixels, both sides multiples of
pooling_kernel_size * patch_size, a small image scaled up to the budget too); PIL resizes to it (bicubic by
default; not at all when it is that size already), rescale in float64 then float32, no normalize by default
(the tower maps [0, 1] to [-1, 1] itself); then P x P patches row-major, each flattened (row, col, channel).
transformers pads every image's patches to the budget with (-1, -1) positions; the padding is masked out of the
tower's attention and dropped after its pooling, so ferrox sends the real patches alone with their (rows, cols)
grid (models/vision/gemma4_vision.py puts each patch's (col, row) position back from it).

Gemma4Processor replaces each image token of the text (`<|image|>`, which the chat template writes for an
image) by begin-of-image, the image's soft tokens (patches / pooling_kernel_size^2 of them: a number that
depends on the image) and end-of-image. The three are added tokens, so the same ids come from the token-level
replacement here. A run of image tokens between begin and end whose length is the image's own count is that
image already expanded (a prompt_token_ids from the processor) and stays as it is.

--mm-processor-kwargs and a request's mm_processor_kwargs take max_soft_tokens (transformers' choices: 70, 140,
280, 560, 1120); the patch and pooling sizes belong to the checkpoint's tower and are refused by name
(processing.py PROCESSOR_KWARGS). Videos and audio (Gemma 4's other inputs) are refused by name. Front-end
code: numpy and PIL only.
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
from PIL import Image

from ferrox.errors import InvalidArgumentError, ModelLoadError, UnsupportedModelError
from ferrox.multimodal.config_fields import (
    PREPROCESSOR_FILE,
    flag,
    image_processor_fields,
    number,
    per_channel,
    positive_int,
)
from ferrox.multimodal.image_processor import resample_filter, rescale_normalize, to_rgb
from ferrox.multimodal.inputs import MultiModalItem, seen_hash
from ferrox.multimodal.processing import ImagePrompts, token_runs

ARCHITECTURE = "Gemma4ForConditionalGeneration"
SOFT_TOKEN_CHOICES = (70, 140, 280, 560, 1120)  # transformers' _SUPPORTED_SOFT_TOKENS
# Gemma4Config's token ids (the released tokenizer's `<|image>`, `<|image|>`, `<image|>`).
DEFAULT_IMAGE_TOKEN_ID = 258_880
DEFAULT_BOI_TOKEN_ID = 255_999
DEFAULT_EOI_TOKEN_ID = 258_882
_DERIVED_CACHE_SIZE = 32  # distinct per-request mm_processor_kwargs whose processors are kept

# Gemma4ImageProcessor's class attributes: what a field means when the file leaves it out (or sets it null).
_PROCESSOR_DEFAULTS: dict[str, Any] = {
    "do_resize": True, "resample": 3, "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": False,
    "image_mean": [0.0, 0.0, 0.0], "image_std": [1.0, 1.0, 1.0], "do_convert_rgb": True, "patch_size": 16,
    "max_soft_tokens": 280, "pooling_kernel_size": 3,
}
_VISION_DEFAULTS = {"patch_size": 16, "pooling_kernel_size": 3}  # Gemma4VisionConfig's


def aspect_ratio_preserving_size(height: int, width: int, patch_size: int, max_patches: int,
                                 pooling_kernel_size: int) -> tuple[int, int]:
    """transformers' get_aspect_ratio_preserving_size: the largest (height, width) with the image's aspect ratio,
    at most max_patches patches, both sides multiples of pooling_kernel_size * patch_size; a side that rounds
    to nothing gets one such multiple (the other then by the ratio, within the budget's longest side).
    ValueError where no such size exists."""
    target = max_patches * patch_size**2
    factor = math.sqrt(target / (height * width))
    side = pooling_kernel_size * patch_size
    new_height = int(math.floor(factor * height / side)) * side
    new_width = int(math.floor(factor * width / side)) * side
    if new_height == 0 and new_width == 0:
        raise ValueError(f"a {width}x{height} image resizes to nothing (sides must be multiples of {side})")
    longest = (max_patches // pooling_kernel_size**2) * side
    if new_height == 0:
        new_height, new_width = side, min(int(math.floor(width / height)) * side, longest)
    elif new_width == 0:
        new_width, new_height = side, min(int(math.floor(height / width)) * side, longest)
    if new_height * new_width > target:
        raise ValueError(f"a {width}x{height} image would resize to {new_width}x{new_height}, more than the "
                         f"{max_patches} patches of {patch_size} pixels an image may have")
    return new_height, new_width


class Gemma4ImageProcessor:
    """`processor(image)` -> (float32 [rows * cols, P*P*3] patches, (rows, cols)) for one PIL image."""

    def __init__(self, config: Mapping[str, Any], where: str = PREPROCESSOR_FILE):
        kind = config.get("image_processor_type")
        if kind is not None and str(kind).removesuffix("Fast").removesuffix("Pil") != "Gemma4ImageProcessor":
            raise UnsupportedModelError(f"{where}: image_processor_type {kind!r} is not Gemma 4's "
                                        "(Gemma4ImageProcessor)")
        fields = {**_PROCESSOR_DEFAULTS,
                  **{k: v for k, v in config.items() if k in _PROCESSOR_DEFAULTS and v is not None}}
        self.where = where
        self.do_resize = flag(fields, "do_resize", where)
        self.resample = Image.Resampling(resample_filter(fields["resample"], where))
        self.do_rescale = flag(fields, "do_rescale", where)
        self.rescale_factor = number(fields["rescale_factor"], "rescale_factor", where)
        self.do_normalize = flag(fields, "do_normalize", where)
        self.image_mean = np.array(per_channel(fields["image_mean"], "image_mean", where), np.float32)
        self.image_std = np.array(per_channel(fields["image_std"], "image_std", where), np.float32)
        self.patch_size = positive_int(fields["patch_size"], "patch_size", where)
        self.pooling_kernel_size = positive_int(fields["pooling_kernel_size"], "pooling_kernel_size", where)
        self.max_soft_tokens = positive_int(fields["max_soft_tokens"], "max_soft_tokens", where)
        if self.max_soft_tokens not in SOFT_TOKEN_CHOICES:  # (transformers refuses the others too)
            raise ModelLoadError(f"{where}: max_soft_tokens must be one of {', '.join(map(str, SOFT_TOKEN_CHOICES))}, "
                                 f"got {self.max_soft_tokens}")
        # do_convert_rgb: every image is made RGB (the tower takes three channels).

    @classmethod
    def from_model_dir(cls, path: str | os.PathLike[str],
                       overrides: Mapping[str, Any] | None = None) -> Gemma4ImageProcessor | None:
        """From preprocessor_config.json, else processor_config.json's image_processor; None when the folder has
        neither. overrides: mm_processor_kwargs' fields over the file's."""
        found = image_processor_fields(path)
        if found is None:
            return None
        if overrides:
            return cls({**found[0], **overrides}, f"{found[1]} with mm_processor_kwargs")
        return cls(found[0], found[1])

    @property
    def max_patches(self) -> int:
        return self.max_soft_tokens * self.pooling_kernel_size**2

    def tokens(self, grid: tuple[int, int]) -> int:
        """The image's soft tokens: its patches pooled k x k."""
        return grid[0] * grid[1] // self.pooling_kernel_size**2

    def __call__(self, image: Image.Image) -> tuple[np.ndarray, tuple[int, int]]:
        """ValueError: an image that fits no size (too long), or without do_resize one whose sides are not
        whole pooled patches or that has more patches than the budget."""
        image = to_rgb(image)
        side = self.patch_size * self.pooling_kernel_size
        if self.do_resize:
            height, width = aspect_ratio_preserving_size(image.height, image.width, self.patch_size,
                                                         self.max_patches, self.pooling_kernel_size)
            if (height, width) != (image.height, image.width):
                image = image.resize((width, height), resample=self.resample)
        elif image.height % side or image.width % side or (
                (image.height // self.patch_size) * (image.width // self.patch_size) > self.max_patches):
            raise ValueError(f"a {image.width}x{image.height} image: without do_resize its sides must be multiples of "
                             f"{side} (patch_size x pooling_kernel_size) within {self.max_patches} patches")
        pixels: np.ndarray = np.asarray(image)
        pixels = rescale_normalize(pixels, self.rescale_factor if self.do_rescale else None,
                                   (self.image_mean, self.image_std) if self.do_normalize else None)
        return self._patches(pixels)

    def _patches(self, pixels: np.ndarray) -> tuple[np.ndarray, tuple[int, int]]:
        """HWC -> [rows * cols, P*P*C]: patches row-major, each (row, col, channel) within the patch
        (transformers' convert_image_to_patches)."""
        height, width, channels = pixels.shape
        p = self.patch_size
        rows, cols = height // p, width // p
        patches = pixels.reshape(rows, p, cols, p, channels).transpose(0, 2, 1, 3, 4)
        return np.ascontiguousarray(patches.reshape(rows * cols, p * p * channels), dtype=np.float32), (rows, cols)


@dataclass(slots=True)
class Gemma4ImagePrompts(ImagePrompts):
    """Gemma 4's prompt rules (module docstring): each image token becomes begin-of-image, the image's soft tokens
    and end-of-image (tokens_per_image is 0: each image has its own count)."""

    boi_token_id: int = DEFAULT_BOI_TOKEN_ID
    eoi_token_id: int = DEFAULT_EOI_TOKEN_ID
    server_kwargs: Mapping[str, Any] = field(default_factory=dict)  # --mm-processor-kwargs
    # Rules derived for a request's mm_processor_kwargs, by those kwargs.
    _derived: dict[tuple[tuple[str, str], ...], Gemma4ImagePrompts] = field(
        default_factory=dict, init=False, repr=False, compare=False)
    _derived_lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False, compare=False)

    def processor_kwargs(self) -> tuple[str, ...]:
        return ("max_soft_tokens",)

    def with_processor_kwargs(self, kwargs: Mapping[str, Any]) -> Gemma4ImagePrompts:
        """A copy whose processor reads the folder with the server's kwargs and then the request's over them;
        cached per distinct kwargs (a flood of distinct values evicts the oldest)."""
        key = tuple(sorted((k, repr(v)) for k, v in kwargs.items()))
        with self._derived_lock:  # (the prompt threads derive concurrently)
            if (found := self._derived.get(key)) is not None:
                return found
        try:
            processor = (Gemma4ImageProcessor.from_model_dir(self.model_dir, {**self.server_kwargs, **kwargs})
                         if self.image_processor is not None else None)
        except (ModelLoadError, UnsupportedModelError) as e:  # a value the processor refuses
            raise InvalidArgumentError(str(e), param="mm_processor_kwargs") from None
        derived = replace(self, image_processor=processor)
        with self._derived_lock:
            if len(self._derived) >= _DERIVED_CACHE_SIZE:
                self._derived.pop(next(iter(self._derived)))
            self._derived[key] = derived
        return derived

    def expand(self, prompt_ids: Sequence[int], images: Sequence[Any], what: str,
               param: str = "multi_modal_data") -> tuple[list[int], list[MultiModalItem]]:
        from ferrox.multimodal.media import image_hash

        self.check_count(len(images), what, param)
        ids = list(prompt_ids)
        runs = token_runs(ids, self.image_token_id)
        if not images and not runs:
            return ids, []
        processor = self.processor_for(what, param) if images else None
        processed = []
        for k, image in enumerate(images):
            digest = image_hash(image)
            try:
                patches, grid = self.process_item(processor, image, digest)
            except ValueError as e:
                raise InvalidArgumentError(f"{what}: image {k}: {e}", param=param) from None
            processed.append((patches, grid, seen_hash(digest, patches, grid)))
        counts = [processor.tokens(grid) for _, grid, _ in processed] if processor is not None else []
        spans = self._spans(ids, runs, counts)
        self.check_placeholders(len(spans), len(images), what, param, " (its tokens are expanded here)")
        out: list[int] = []
        items: list[MultiModalItem] = []
        at = 0
        for (start, length, expanded), (patches, grid, digest), count in zip(spans, processed, counts, strict=True):
            out.extend(ids[at:start])
            if not expanded:
                out.append(self.boi_token_id)
            items.append(MultiModalItem.from_pixels(len(out), count, patches, digest, grid=list(grid)))
            out.extend([self.image_token_id] * count)
            if not expanded:
                out.append(self.eoi_token_id)
            at = start + length
        out.extend(ids[at:])
        return out, items

    def _spans(self, ids: list[int], runs: list[tuple[int, int]], counts: list[int]) -> list[tuple[int, int, bool]]:
        """(start, length, already expanded) of each image's placeholder, in order: a run wrapped in begin / end
        of image whose length is the next image's count is that image expanded; any other image token is one
        placeholder. (More or fewer placeholders than images: the caller refuses.)"""
        spans: list[tuple[int, int, bool]] = []
        for start, length in runs:
            k = len(spans)
            wrapped = (start > 0 and ids[start - 1] == self.boi_token_id and start + length < len(ids)
                       and ids[start + length] == self.eoi_token_id)
            if wrapped and k < len(counts) and counts[k] == length:
                spans.append((start, length, True))
            else:
                spans.extend((start + i, 1, False) for i in range(length))
        return spans


def gemma4_image_prompts(model_dir: str, hf_config: Mapping[str, Any], tokenizer: Any, *, limit: int | None,
                         allowed_local_media_path: str | None,
                         processor_kwargs: Mapping[str, Any] | None = None) -> Gemma4ImagePrompts | None:
    """The prompt rules of a Gemma 4 folder (hf_config: config.json, less its text_config); None for one without
    a vision_config, or served as text (limit 0) by a tokenizer without the image token. The placeholder text a
    string-content chat template gets per image is the image token. The processor's patch and pooling sizes
    must be the tower's (config.json's vision_config)."""
    if hf_config.get("vision_config") is None:
        return None
    token_id = int(hf_config.get("image_token_id") or DEFAULT_IMAGE_TOKEN_ID)
    placeholder = tokenizer.id_to_token(token_id)
    if placeholder is None:
        if limit == 0:
            return None
        raise UnsupportedModelError(f"config.json: image_token_id {token_id} is not in the tokenizer's vocabulary")
    processor = Gemma4ImageProcessor.from_model_dir(model_dir, processor_kwargs) if os.path.isdir(model_dir) else None
    vision = {**_VISION_DEFAULTS, **{k: v for k, v in (hf_config.get("vision_config") or {}).items() if v is not None}}
    if processor is not None:
        for name in ("patch_size", "pooling_kernel_size"):
            if getattr(processor, name) != vision[name]:
                raise UnsupportedModelError(f"{processor.where}: {name} {getattr(processor, name)} differs from the "
                                            f"vision tower's {vision[name]} (config.json's vision_config)")
    prompts = Gemma4ImagePrompts(token_id, 0, placeholder, processor, model_dir, limit, allowed_local_media_path,
                                 boi_token_id=int(hf_config.get("boi_token_id") or DEFAULT_BOI_TOKEN_ID),
                                 eoi_token_id=int(hf_config.get("eoi_token_id") or DEFAULT_EOI_TOKEN_ID))
    prompts.server_kwargs = dict(processor_kwargs or {})
    return prompts
