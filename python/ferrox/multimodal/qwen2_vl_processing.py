"""Qwen2-VL and Qwen2.5-VL images: their patches and the tokens each image becomes.

transformers' Qwen2VLImageProcessor (the PIL one, `Qwen2VLImageProcessorPil` in transformers 5; Qwen2.5-VL
uses the same), for one image: RGB; smart_resize picks the size (both sides multiples of
factor = patch_size * merge_size, the area kept within [min_pixels, max_pixels], the aspect ratio as near
as those allow), PIL resizes to it (bicubic by default), rescale in float64 then float32, normalize in
float32 (OpenAI CLIP's mean and std by default); the image counts as temporal_patch_size identical frames,
one temporal patch (grid_t = 1); and it is cut into P x P patches, flattened [grid_h * grid_w, C*T*P*P]
with each merge x merge square of patches consecutive (squares row-major, patches row-major in a square;
values in a patch C, T, P, P order).

Qwen2VLProcessor replaces each `<|image_pad|>` of the text by grid_t * grid_h * grid_w / merge^2 of them (one
per row the tower's merger gives): a number that depends on the image's size. One MultiModalItem per image
carries its patches and its grid, which the tower needs (models/vision/qwen2_vl_vision.py). Front-end code:
numpy and PIL only. Videos (`<|video_pad|>`, expanded the same way) are cut by qwen2_vl_video_processing.py.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any

import numpy as np
from PIL import Image

from ferrox.errors import InvalidArgumentError, ModelLoadError, UnsupportedModelError
from ferrox.multimodal.config_fields import (
    PREPROCESSOR_FILE,
    flag,
    image_processor_fields,
    positive_int,
)
from ferrox.multimodal.image_processor import resample_filter, to_rgb
from ferrox.multimodal.inputs import MultiModalItem, seen_hash
from ferrox.multimodal.media_prompts import MediaPrompts
from ferrox.multimodal.pixel_scaling import PixelScaling
from ferrox.multimodal.processing import processor_kwargs_for
from ferrox.multimodal.processor_cache import video_key

ARCHITECTURES = ("Qwen2VLForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration")
# Qwen3-VL's rules (16-pixel patches, videos with their frames' timestamps); Qwen3.5 / Qwen3.6 share them.
QWEN3_ARCHITECTURES = ("Qwen3VLForConditionalGeneration", "Qwen3VLMoeForConditionalGeneration",
                       "Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration")
# Qwen2VLConfig's / Qwen2_5_VLConfig's token ids.
DEFAULT_IMAGE_TOKEN_ID = 151_655  # <|image_pad|>
DEFAULT_VISION_START_TOKEN_ID = 151_652  # <|vision_start|>
DEFAULT_VISION_END_TOKEN_ID = 151_653  # <|vision_end|>
DEFAULT_VIDEO_TOKEN_ID = 151_656  # <|video_pad|>
MAX_ASPECT_RATIO = 200  # smart_resize refuses longer images

# The vision configs' defaults for the keys the processor must agree with (the same in both families).
_VISION_DEFAULTS = {"patch_size": 14, "temporal_patch_size": 2, "spatial_merge_size": 2}
# Qwen2VLImageProcessor's class attributes: what a field means when the file leaves it out (or sets it null).
_PROCESSOR_DEFAULTS: dict[str, Any] = {
    "do_resize": True, "resample": 3, "size": {"shortest_edge": 56 * 56, "longest_edge": 28 * 28 * 1280},
    "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
    "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711],
    "do_convert_rgb": True, "patch_size": 14, "temporal_patch_size": 2, "merge_size": 2,
}
_PROCESSOR_TYPES = ("Qwen2VLImageProcessor", "Qwen2_5_VLImageProcessor")


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """transformers' smart_resize: each side rounded to a multiple of `factor`; an area over max_pixels
    scaled down (rounding down), one under min_pixels scaled up (rounding up)."""
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ValueError(f"a {width}x{height} image is too long: its aspect ratio must be at most "
                         f"{MAX_ASPECT_RATIO}")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


class QwenVLImageProcessor:
    """`processor(image)` -> (float32 [grid_t * grid_h * grid_w, C*T*P*P] patches, (grid_t, grid_h, grid_w))
    for one PIL image."""

    def __init__(self, config: Mapping[str, Any], where: str = PREPROCESSOR_FILE):
        kind = config.get("image_processor_type")
        if kind is not None:
            base = str(kind)
            for suffix in ("Fast", "Pil"):
                base = base.removesuffix(suffix)
            if base not in _PROCESSOR_TYPES:
                raise UnsupportedModelError(f"{where}: image_processor_type {kind!r} is not a Qwen2-VL one "
                                            f"({', '.join(_PROCESSOR_TYPES)})")
        fields = {**_PROCESSOR_DEFAULTS,
                  **{k: v for k, v in config.items() if k in _PROCESSOR_DEFAULTS and v is not None}}
        self.where = where
        self.min_pixels, self.max_pixels = _pixel_bounds(config, fields["size"], where)
        self.do_resize = flag(fields, "do_resize", where)
        self.resample = Image.Resampling(resample_filter(fields["resample"], where))
        self.scaling = PixelScaling.read(fields, where)
        self.patch_size = positive_int(fields["patch_size"], "patch_size", where)
        self.temporal_patch_size = positive_int(fields["temporal_patch_size"], "temporal_patch_size", where)
        self.merge_size = positive_int(fields["merge_size"], "merge_size", where)
        # do_convert_rgb: every image is made RGB (the tower takes three channels).

    @classmethod
    def from_model_dir(cls, path: str | os.PathLike[str],
                       overrides: Mapping[str, Any] | None = None) -> QwenVLImageProcessor | None:
        """From preprocessor_config.json, else processor_config.json's image_processor (transformers 5
        saves only that); None when the folder has neither. overrides: --mm-processor-kwargs' fields."""
        found = image_processor_fields(path)
        if found is None:
            return None
        if overrides:
            return cls({**found[0], **overrides}, f"{found[1]} with mm_processor_kwargs")
        return cls(found[0], found[1])

    def tokens(self, grid: tuple[int, int, int]) -> int:
        """The image's rows after the tower's merger: its placeholder tokens."""
        return grid[0] * grid[1] * grid[2] // self.merge_size**2

    def __call__(self, image: Image.Image) -> tuple[np.ndarray, tuple[int, int, int]]:
        """ValueError: an image smart_resize refuses (too long) or, without do_resize, one whose sides are
        not whole merged squares."""
        image = to_rgb(image)
        factor = self.patch_size * self.merge_size
        if self.do_resize:
            height, width = smart_resize(image.height, image.width, factor, self.min_pixels, self.max_pixels)
            image = image.resize((width, height), resample=self.resample)
        elif image.height % factor or image.width % factor:
            raise ValueError(f"a {image.width}x{image.height} image: without do_resize its sides must be multiples "
                             f"of {factor} (patch_size x merge_size)")
        pixels: np.ndarray = np.asarray(image)
        pixels = self.scaling.apply(pixels)
        return self._patches(pixels)

    def _patches(self, pixels: np.ndarray) -> tuple[np.ndarray, tuple[int, int, int]]:
        """HWC -> [grid_h * grid_w, C*T*P*P]: merge squares row-major, patches row-major within one, each
        patch (C, T, P, P) with its T frames the same image."""
        height, width, channels = pixels.shape
        p, m, t = self.patch_size, self.merge_size, self.temporal_patch_size
        grid_h, grid_w = height // p, width // p
        squares = pixels.reshape(grid_h // m, m, p, grid_w // m, m, p, channels)
        squares = squares.transpose(0, 3, 1, 4, 6, 2, 5)  # (square row, square col, row, col, C, P, P)
        frames = np.broadcast_to(squares[:, :, :, :, :, None], (*squares.shape[:5], t, p, p))
        patches = np.ascontiguousarray(frames.reshape(grid_h * grid_w, channels * t * p * p), dtype=np.float32)
        return patches, (1, grid_h, grid_w)


@dataclass(slots=True)
class QwenVLImagePrompts(MediaPrompts):
    """Qwen2-VL / Qwen2.5-VL prompt rules: each `<|image_pad|>` becomes its image's tokens, a number that
    depends on the image (tokens_per_image is 0: unused), and each `<|video_pad|>` its video's. A run of
    image (video) tokens is read as one token per image (video) (placeholders side by side) or, when its
    length is the item's own count, that item already expanded; a prompt that reads both ways, or neither,
    is refused. Images and videos pair with their own placeholders, each in prompt order."""

    # (MediaPrompts: video_processor, a qwen2_vl_video_processing.QwenVLVideoProcessor; video_placeholder
    # `<|vision_start|><|video_pad|><|vision_end|>`; tokenizer: Qwen3-VL's, for the timestamps.)
    # Qwen2.5-VL: its items carry second_per_grid_ts (the rotary spaces a video's frames by seconds).
    seconds_per_grid: bool = False
    # Qwen3-VL: a video's `<|vision_start|><|video_pad|><|vision_end|>` becomes, per temporal patch, its
    # `<t seconds>` text then that frame's pads wrapped in vision start / end (_timestamped_pieces). The text is
    # tokenized on its own, as vLLM's token-level replacement does (transformers tokenizes it with the prompt:
    # the same ids wherever the text before it ends a pre-token, as a chat template's newline does).
    frame_timestamps: bool = False
    vision_start_id: int = -1
    vision_end_id: int = -1
    allowed_kwargs: tuple[str, ...] = ()  # the mm_processor_kwargs keys the family takes (PROCESSOR_KWARGS)

    def processor_kwargs(self) -> tuple[str, ...]:
        return self.allowed_kwargs

    def expand(self, prompt_ids: Sequence[int], images: Sequence[Any], what: str,
               param: str = "multi_modal_data") -> tuple[list[int], list[MultiModalItem]]:
        """`images`: the prompt's decoded media in order, PIL images and multimodal.video.Video frames."""
        from ferrox.multimodal.media import image_hash

        stills, videos, ids, runs, video_runs = self.media_runs(prompt_ids, images, what, param)
        if not images and not runs and not video_runs:
            return ids, []
        # (start, length, maker) of each placeholder, both modalities; maker(offset) -> (item, its tokens)
        pieces: list[tuple[int, int, Any]] = []
        digests = [image_hash(image) for image in stills]
        processed = self._processed(stills, digests, self.processor_for(what, param) if stills else None, "__call__",
                                    "image", what, param)
        counts = [self.image_processor.tokens(grid) for _, grid in processed] if stills else []
        for span, (patches, grid), count, digest in zip(self._spans(runs, counts, what, param), processed, counts,
                                                         digests, strict=True):
            pieces.append((*span, lambda at, n=count, p=patches, g=grid, d=digest: (MultiModalItem.from_pixels(
                at, n, p, seen_hash(d, p, g), grid=list(g)), [self.image_token_id] * n)))
        if videos or video_runs:
            pieces.extend(self._video_pieces(video_runs, videos, what, param, ids))
        out: list[int] = []
        items: list[MultiModalItem] = []
        at = 0
        for start, length, make in sorted(pieces, key=lambda piece: piece[0]):
            out.extend(ids[at:start])
            item, tokens = make(len(out))
            items.append(item)
            out.extend(tokens)
            at = start + length
        out.extend(ids[at:])
        return out, items

    def _video_pieces(self, runs: list[tuple[int, int]], videos: list[Any], what: str, param: str,
                      ids: list[int]) -> list[tuple[int, int, Any]]:
        if self.video_processor is None:
            raise InvalidArgumentError(f"{what}: {self.video_refusal or 'this model takes no videos'}", param=param)
        self.check_video_count(len(videos), what, param)
        if self.frame_timestamps:
            return self._timestamped_pieces(runs, videos, ids, what, param)
        processed = self._processed(videos, [video_key(v) for v in videos], self.video_processor, "__call__", "video",
                                    what, param)
        counts = [self.video_processor.tokens(grid) for _, grid in processed]
        spans = self._spans(runs, counts, what, param, "video", self.video_placeholder or "")
        pieces = []
        for span, (patches, grid), count, video in zip(spans, processed, counts, videos, strict=True):
            seconds = self.video_processor.second_per_grid_t(video) if self.seconds_per_grid else None

            def make(at: int, n: int = count, p: Any = patches, g: Any = grid, v: Any = video,
                     s: float | None = seconds) -> tuple[MultiModalItem, list[int]]:
                return (MultiModalItem.from_pixels(at, n, p, seen_hash(v.hash(), p, g), grid=list(g), modality="video",
                                                   second_per_grid_ts=s), [self.video_token_id] * n)

            pieces.append((*span, make))
        return pieces

    def _timestamped_pieces(self, runs: list[tuple[int, int]], videos: list[Any], ids: list[int], what: str,
                            param: str) -> list[tuple[int, int, Any]]:
        """Qwen3-VL: each video's wrapped pad (three tokens) -> one item whose run holds every frame's timestamp
        text and vision start / end, embed_positions marking the pads (as vLLM selects them). Its prompt must
        hold the wrapped single pad: vLLM finds nothing else to replace (an already expanded video included)."""
        wrapped = [(start - 1, 3) for start, length in runs if length == 1 and 0 < start < len(ids) - 1
                   and ids[start - 1] == self.vision_start_id and ids[start + 1] == self.vision_end_id]
        if len(wrapped) != len(runs) or len(runs) != len(videos):
            raise InvalidArgumentError(
                f"{what}: the prompt has {sum(n for _, n in runs)} video token(s) for {len(videos)} video(s); put one "
                f"{self.video_placeholder!r} where each video goes (Qwen3-VL writes its frames' timestamps there)",
                param=param)
        processed = self._processed(videos, [video_key(v) for v in videos], self.video_processor, "prepare", "video",
                                    what, param)
        pieces = []
        for span, (patches, grid, seconds), video in zip(wrapped, processed, videos, strict=True):
            pads = self.video_processor.tokens((1, *grid[1:]))
            tokens: list[int] = []
            where: list[int] = []
            for t in seconds:
                tokens += self.tokenizer.encode(f"<{t:.1f} seconds>", add_special_tokens=False)
                tokens.append(self.vision_start_id)
                where.extend(range(len(tokens), len(tokens) + pads))
                tokens += [self.video_token_id] * pads + [self.vision_end_id]

            def make(at: int, p: Any = patches, g: Any = grid, v: Any = video, ids: list[int] = tokens,
                     w: list[int] = where) -> tuple[MultiModalItem, list[int]]:
                return MultiModalItem.from_pixels(at, len(ids), p, seen_hash(v.hash(), p, g), grid=list(g), embed_positions=w,
                                                  modality="video"), ids

            pieces.append((*span, make))
        return pieces

    def _processed(self, media: list[Any], digests: list[str], processor: Any, method: str, kind: str, what: str,
                   param: str) -> list[Any]:
        """`processor.<method>` of each item (through the processor cache); its ValueError names the item."""
        out = []
        for k, (one, digest) in enumerate(zip(media, digests, strict=True)):
            try:
                out.append(self.process_item(processor, one, digest, method))
            except ValueError as e:
                raise InvalidArgumentError(f"{what}: {kind} {k}: {e}", param=param) from None
        return out

    def _spans(self, runs: list[tuple[int, int]], counts: list[int], what: str, param: str, kind: str = "image",
               pad: str = "") -> list[tuple[int, int]]:
        """(start, length) of each image's (video's) placeholder: the one reading of the runs that gives every
        item one (module rule above)."""
        images = len(counts)

        @cache
        def readings(r: int, k: int) -> int:
            """Readings of runs[r:] for images[k:], counted up to 2."""
            if r == len(runs):
                return int(k == images)
            length = runs[r][1]
            total = readings(r + 1, k + length) if k + length <= images else 0
            if length > 1 and k < images and counts[k] == length:
                total += readings(r + 1, k + 1)
            return min(total, 2)

        found = readings(0, 0)
        pad = pad or self.placeholder
        if found != 1:
            tokens = sum(n for _, n in runs)
            reason = "can be read two ways for" if found else "do not match"
            raise InvalidArgumentError(
                f"{what}: the prompt's {tokens} {kind} token(s) in {len(runs)} run(s) {reason} {images} {kind}(s) of "
                f"{counts} tokens; put one {pad!r} where each {kind} goes (its tokens are expanded here)",
                param=param)
        spans: list[tuple[int, int]] = []
        k = 0
        for r, (start, length) in enumerate(runs):
            if length > 1 and k < images and counts[k] == length and readings(r + 1, k + 1):
                spans.append((start, length))
                k += 1
            else:
                spans.extend((start + i, 1) for i in range(length))
                k += length
        return spans


def qwen_vl_image_prompts(model_dir: str, hf_config: Mapping[str, Any], tokenizer: Any, *, limit: int | None,
                          allowed_local_media_path: str | None,
                          processor_kwargs: Mapping[str, Any] | None = None,
                          video_limit: int | None = None) -> QwenVLImagePrompts:
    """The prompt rules of a Qwen2-VL / Qwen2.5-VL folder (hf_config: config.json). The placeholder text a
    string-content chat template gets per image is `<|vision_start|><|image_pad|><|vision_end|>`, as
    Qwen's own templates write it (`<|video_pad|>` for a video). Qwen3-VL shares the image rules; its videos
    are cut by qwen3_vl_video_processing.py and written with their frames' timestamps."""
    token_id = int(hf_config.get("image_token_id", DEFAULT_IMAGE_TOKEN_ID))
    pad = tokenizer.id_to_token(token_id)
    if pad is None:
        raise UnsupportedModelError(f"config.json: image_token_id {token_id} is not in the tokenizer's vocabulary")
    start = tokenizer.id_to_token(int(hf_config.get("vision_start_token_id", DEFAULT_VISION_START_TOKEN_ID)))
    end = tokenizer.id_to_token(int(hf_config.get("vision_end_token_id", DEFAULT_VISION_END_TOKEN_ID)))
    placeholder = f"{start}{pad}{end}" if start is not None and end is not None else pad
    vision = {**_VISION_DEFAULTS, **{k: v for k, v in (hf_config.get("vision_config") or {}).items() if v is not None}}
    processor = QwenVLImageProcessor.from_model_dir(model_dir, processor_kwargs) if os.path.isdir(model_dir) else None
    if processor is not None:
        for ours, theirs in (("patch_size", "patch_size"), ("temporal_patch_size", "temporal_patch_size"),
                             ("merge_size", "spatial_merge_size")):
            if getattr(processor, ours) != vision[theirs]:
                raise UnsupportedModelError(f"{processor.where}: {ours} {getattr(processor, ours)} differs from the "
                                            f"vision tower's {theirs} {vision[theirs]} (config.json)")
    prompts = QwenVLImagePrompts(token_id, 0, placeholder, processor, model_dir, limit, allowed_local_media_path)
    prompts.allowed_kwargs = processor_kwargs_for(list(hf_config.get("architectures") or []))
    prompts.server_kwargs = dict(processor_kwargs or {})
    archs = set(hf_config.get("architectures") or [])
    name = sorted(archs)[0] if archs else "this model"
    timestamps = bool(archs & set(QWEN3_ARCHITECTURES))
    if not archs & set(ARCHITECTURES) and not timestamps:
        prompts.video_refusal = f"{name} takes no video inputs in ferrox yet"
        return prompts
    from ferrox.multimodal.qwen2_vl_video_processing import QwenVLVideoProcessor, check_tower
    from ferrox.multimodal.qwen3_vl_video_processing import Qwen3VLVideoProcessor

    video_id = int(hf_config.get("video_token_id", DEFAULT_VIDEO_TOKEN_ID))
    video_pad = tokenizer.id_to_token(video_id)
    kind = Qwen3VLVideoProcessor if timestamps else QwenVLVideoProcessor
    video = kind.from_model_dir(model_dir, processor_kwargs) if os.path.isdir(model_dir) else None
    if video_pad is None or video is None or (timestamps and (start is None or end is None)):
        prompts.video_refusal = f"{name} takes no video inputs from this folder: " + (
            f"config.json's video_token_id {video_id} is not in the tokenizer's vocabulary" if video_pad is None
            else f"model folder {model_dir} has no video processor config" if video is None
            else "its tokenizer lacks the vision start / end tokens a video's frames are wrapped in")
        return prompts
    check_tower(video, vision)
    if timestamps:
        prompts.frame_timestamps = True
        prompts.tokenizer = tokenizer
        prompts.vision_start_id = int(hf_config.get("vision_start_token_id", DEFAULT_VISION_START_TOKEN_ID))
        prompts.vision_end_id = int(hf_config.get("vision_end_token_id", DEFAULT_VISION_END_TOKEN_ID))
    prompts.video_processor = video
    prompts.video_token_id = video_id
    prompts.video_placeholder = f"{start}{video_pad}{end}" if start is not None and end is not None else video_pad
    prompts.video_limit = video_limit
    prompts.seconds_per_grid = "Qwen2_5_VLForConditionalGeneration" in archs
    return prompts


def _pixel_bounds(config: Mapping[str, Any], size: Any, where: str) -> tuple[int, int]:
    """(min_pixels, max_pixels): size {shortest_edge, longest_edge} as transformers 5 writes it, each
    overridden by a top-level min_pixels / max_pixels (the hub's files); size {min_pixels, max_pixels}
    (transformers 4.45's layout) where neither gives one."""
    if not isinstance(size, Mapping):
        raise UnsupportedModelError(f"{where}: size must be {{shortest_edge, longest_edge}}, got {size!r}")
    low = config.get("min_pixels")
    high = config.get("max_pixels")
    low = size.get("shortest_edge", size.get("min_pixels")) if low is None else low
    high = size.get("longest_edge", size.get("max_pixels")) if high is None else high
    if low is None or high is None:
        raise UnsupportedModelError(f"{where}: size must be {{shortest_edge, longest_edge}} (or min_pixels and "
                                    f"max_pixels given), got {size!r}")
    low, high = positive_int(low, "min_pixels", where), positive_int(high, "max_pixels", where)
    if low > high:
        raise ModelLoadError(f"{where}: min_pixels {low} is more than max_pixels {high}")
    return low, high




