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

Videos (`<|video|>`, a timestamped run of frames each wrapped as an image is): gemma4_video.py. Images and videos
pair with their own placeholders, each in prompt order; a video already expanded (its frames' runs between begin
and end of image, each of the frame's count) stays as it is.

--mm-processor-kwargs and a request's mm_processor_kwargs take max_soft_tokens (transformers' choices: 70, 140,
280, 560, 1120: an image's budget and, as transformers passes it to both processors, a video frame's) and
num_frames (the frames sampled of a whole video); the patch and pooling sizes belong to the checkpoint's tower and
are refused by name (processing.py PROCESSOR_KWARGS). Audio clips (`<|audio|>`, a folder with an audio_config
and a feature extractor config): gemma4_audio_processing.py, paired with their own placeholders in prompt order;
refused by name for a folder without them. Front-end code: numpy and PIL only (videos: torch, as transformers
resizes them).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
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

ARCHITECTURE = "Gemma4ForConditionalGeneration"
SOFT_TOKEN_CHOICES = (70, 140, 280, 560, 1120)  # transformers' _SUPPORTED_SOFT_TOKENS
# Gemma4Config's token ids (the released tokenizer's `<|image>`, `<|image|>`, `<image|>`).
DEFAULT_IMAGE_TOKEN_ID = 258_880
DEFAULT_BOI_TOKEN_ID = 255_999
DEFAULT_EOI_TOKEN_ID = 258_882
DEFAULT_VIDEO_TOKEN_ID = 258_884  # `<|video|>`

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
        self.scaling = PixelScaling.read(fields, where)
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
        pixels = self.scaling.apply(pixels)
        return self._patches(pixels)

    def _patches(self, pixels: np.ndarray) -> tuple[np.ndarray, tuple[int, int]]:
        """HWC -> [rows * cols, P*P*C]: patches row-major, each (row, col, channel) within the patch
        (transformers' convert_image_to_patches)."""
        height, width, channels = pixels.shape
        p = self.patch_size
        rows, cols = height // p, width // p
        patches = pixels.reshape(rows, p, cols, p, channels).transpose(0, 2, 1, 3, 4)
        return np.ascontiguousarray(patches.reshape(rows * cols, p * p * channels), dtype=np.float32), (rows, cols)


# (start, length) of a placeholder in the prompt, the tokens it becomes, and its items (offsets from its start)
_Piece = tuple[int, int, list[int], list[MultiModalItem]]


@dataclass(slots=True)
class Gemma4ImagePrompts(MediaPrompts):
    """Gemma 4's prompt rules (module docstring): each image token becomes begin-of-image, the image's soft tokens
    and end-of-image (tokens_per_image is 0: each image has its own count); each video token its timestamped
    frames (gemma4_video.py)."""

    boi_token_id: int = DEFAULT_BOI_TOKEN_ID
    eoi_token_id: int = DEFAULT_EOI_TOKEN_ID
    # (MediaPrompts: video_processor, a gemma4_video.Gemma4VideoProcessor; video_token_id, set even where videos
    # are refused: a `<|video|>` beside media is then refused; video_placeholder `<|video|>`; tokenizer: for the
    # frames' timestamps.)

    def processor_kwargs(self) -> tuple[str, ...]:
        return ("max_soft_tokens", "num_frames")

    def expand(self, prompt_ids: Sequence[int], images: Sequence[Any], what: str,
               param: str = "multi_modal_data") -> tuple[list[int], list[MultiModalItem]]:
        """`images`: the prompt's decoded media in order, PIL images, multimodal.video.Video frames and
        multimodal.audio.Audio clips."""
        from ferrox.multimodal.audio import is_audio
        from ferrox.multimodal.gemma4_audio_processing import audio_pieces

        stills, videos, ids, runs, video_runs = self.media_runs(prompt_ids, images, what, param)
        clips = [m for m in images if is_audio(m)]
        # (a folder that takes no audio reads a stray `<|audio|>` as text, as before audio was taken)
        audio_marks = self.audio_processor is not None and self.audio_token_id in ids
        if not images and not runs and not video_runs and not audio_marks:
            return ids, []
        pieces = self._image_pieces(ids, runs, stills, what, param)
        if videos or video_runs:
            pieces += self._video_pieces(ids, video_runs, videos, what, param)
        if clips or audio_marks:
            pieces += audio_pieces(self, ids, clips, what, param)
        out: list[int] = []
        items: list[MultiModalItem] = []
        at = 0
        for start, length, tokens, placed in sorted(pieces, key=lambda piece: piece[0]):
            out.extend(ids[at:start])
            for item in placed:  # (their offsets are from the piece's start)
                item.offset += len(out)
            items.extend(placed)
            out.extend(tokens)
            at = start + length
        out.extend(ids[at:])
        return out, items

    def _image_pieces(self, ids: list[int], runs: list[tuple[int, int]], images: list[Any], what: str,
                      param: str) -> list[_Piece]:
        from ferrox.multimodal.media import image_hash

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
        pieces: list[_Piece] = []
        for (start, length, expanded), (patches, grid, digest), count in zip(spans, processed, counts, strict=True):
            tokens = [self.image_token_id] * count
            item = MultiModalItem.from_pixels(0 if expanded else 1, count, patches, digest, grid=list(grid))
            pieces.append((start, length, tokens if expanded else [self.boi_token_id, *tokens, self.eoi_token_id],
                           [item]))
        return pieces

    def _video_pieces(self, ids: list[int], runs: list[tuple[int, int]], videos: list[Any], what: str,
                      param: str) -> list[_Piece]:
        """Each video's frames at its placeholder (a single `<|video|>`), or at its frames' runs already expanded
        (each wrapped in begin / end of image: kept as they are, the text between them too); one item a frame."""
        from ferrox.multimodal.gemma4_video import frame_tokens
        from ferrox.multimodal.processor_cache import video_key

        processor = self.video_processor
        if processor is None:
            raise InvalidArgumentError(f"{what}: {self.video_refusal or 'this model takes no videos'}", param=param)
        self.check_video_count(len(videos), what, param)
        processed = []
        for k, video in enumerate(videos):
            key = video_key(video)
            try:
                processed.append((*self.process_item(processor, video, key, "prepare"), key))
            except ValueError as e:
                raise InvalidArgumentError(f"{what}: video {k}: {e}", param=param) from None
        marks: list[tuple[int, int, bool]] = []  # (start, length, an expanded frame) of each video token run
        for start, length in runs:
            if 0 < start and start + length < len(ids) and ids[start - 1] == self.boi_token_id \
                    and ids[start + length] == self.eoi_token_id:
                marks.append((start, length, True))
            else:  # placeholders side by side: one video each
                marks.extend((start + i, 1, False) for i in range(length))
        mismatch = InvalidArgumentError(
            f"{what}: the prompt's {sum(n for _, n in runs)} video token(s) do not match {len(videos)} video(s); put "
            f"one {self.video_placeholder or '<|video|>'!r} where each video goes (its frames are expanded here)",
            param=param)
        pieces: list[_Piece] = []
        m = 0
        for patches, grid, seconds, key in processed:
            count = processor.tokens(grid)
            frames = [MultiModalItem.from_pixels(0, count, frame, seen_hash(key, frame, grid), grid=list(grid),
                                                 modality="video") for frame in patches]
            if m < len(marks) and not marks[m][2]:
                tokens, starts = frame_tokens(self.tokenizer, seconds, count, self.boi_token_id, self.video_token_id,
                                              self.eoi_token_id)
                for item, at in zip(frames, starts, strict=True):
                    item.offset = at
                pieces.append((marks[m][0], 1, tokens, frames))
                m += 1
                continue
            expanded = marks[m:m + len(frames)]
            if len(expanded) < len(frames) or any(not wrapped or n != count for _, n, wrapped in expanded):
                raise mismatch
            pieces.extend((start, n, [self.video_token_id] * n, [item])
                          for (start, n, _), item in zip(expanded, frames, strict=True))
            m += len(frames)
        if m != len(marks):
            raise mismatch
        return pieces

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
                         processor_kwargs: Mapping[str, Any] | None = None,
                         video_limit: int | None = None, audio_limit: int | None = None) -> Gemma4ImagePrompts | None:
    """The prompt rules of a Gemma 4 folder (hf_config: config.json, less its text_config); None for one without
    a vision_config, or served as text (limit 0) by a tokenizer without the image token. The placeholder text a
    string-content chat template gets per image (video) is the image (video) token. The processors' patch and
    pooling sizes must be the tower's (config.json's vision_config): a video processor's that are not leave the
    folder's videos refused, its images taken."""
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
    _add_videos(prompts, model_dir, hf_config, tokenizer, vision, processor_kwargs, video_limit)
    from ferrox.multimodal.gemma4_audio_processing import add_audio

    add_audio(prompts, model_dir, hf_config, tokenizer, audio_limit)
    return prompts


def _add_videos(prompts: Gemma4ImagePrompts, model_dir: str, hf_config: Mapping[str, Any], tokenizer: Any,
                vision: Mapping[str, Any], processor_kwargs: Mapping[str, Any] | None, limit: int | None) -> None:
    """The folder's video rules on `prompts`, or why its videos are refused (video_refusal)."""
    from ferrox.multimodal.gemma4_video import Gemma4VideoProcessor

    prompts.video_token_id = video_id = int(hf_config.get("video_token_id") or DEFAULT_VIDEO_TOKEN_ID)
    placeholder = tokenizer.id_to_token(video_id)
    try:
        video = Gemma4VideoProcessor.from_model_dir(model_dir) if os.path.isdir(model_dir) else None
        for name in ("patch_size", "pooling_kernel_size"):
            if video is not None and getattr(video, name) != vision[name]:
                raise UnsupportedModelError(f"{video.where}: {name} {getattr(video, name)} differs from the vision "
                                            f"tower's {vision[name]} (config.json's vision_config)")
    except (ModelLoadError, UnsupportedModelError) as e:
        prompts.video_refusal = f"Gemma 4 takes no video inputs from this folder: {e}"
        return
    if placeholder is None or video is None:
        prompts.video_refusal = "Gemma 4 takes no video inputs from this folder: " + (
            f"config.json's video_token_id {video_id} is not in the tokenizer's vocabulary" if placeholder is None
            else f"model folder {model_dir} has no video processor config")
        return
    if processor_kwargs:  # (a value the processor refuses fails the start, as the image processor's does)
        video = Gemma4VideoProcessor.from_model_dir(model_dir, processor_kwargs)
    prompts.video_processor, prompts.video_placeholder, prompts.video_limit = video, placeholder, limit
    prompts.tokenizer = tokenizer
