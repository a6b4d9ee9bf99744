"""Gemma 4 videos: which frames, their patches, and the timestamped frames a video becomes in the prompt.

transformers' Gemma4VideoProcessor and Gemma4Processor, on the frames vLLM's loader picked (video.py: 32 of a file,
which is also transformers' num_frames):
- frames: as given. A video marked do_sample_frames (vLLM's flag: the frames are the whole video, as the loader
  keeps a short file, or every frame under media_io_kwargs num_frames -1) is sampled again as transformers'
  default_sample_indices_fn samples it: num_frames (32; mm_processor_kwargs num_frames; null: every frame) at
  `arange(n) * total // n`, at most the video's frames (transformers refuses more: a short file would never
  pass), unless the folder's do_sample_frames is false;
- size: each frame fitted to max_soft_tokens (70 a frame by default, where an image has 280) as an image is
  (gemma4_processing.aspect_ratio_preserving_size), resized by torchvision on uint8 tensors (bicubic with
  antialiasing: so in torch here, as qwen2_vl_video_processing.py does, not PIL as Gemma 4's images are);
- values: rescale and normalize fused into (x - mean/r) / (std/r) in float32 (the default mean 0 and std 1 leave
  x / 255); then each frame's P x P patches row-major, each flattened (row, col, channel), as an image's;
- the prompt: Gemma4Processor writes each `<|video|>` as, per frame, its `mm:ss` timestamp (the source frame's
  index over the source frame rate, 24 when unknown; whole minutes and seconds, two digits each), a space,
  begin-of-image, the frame's soft tokens as `<|video|>` tokens and end-of-image, the frames joined by spaces.
  The timestamp text is tokenized on its own, as vLLM's token-level replacement does (transformers tokenizes the
  first with the prompt's text before it: the same ids wherever that text ends a pre-token, as a chat template's
  newline does; the later ones sit between end- and begin-of-image, the same ids either way).

The model embeds each frame as an image (models/gemma4.py: the same tower and embedder); each frame is an item of
its own (modality "video"), so a frame's tokens attend to each other both ways on the sliding layers and not to
the other frames', as transformers' mm_token_type_ids group them (boi, eoi and the timestamps are text).
mm_processor_kwargs max_soft_tokens sets a frame's budget too (transformers passes it to both processors).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ferrox.errors import ModelLoadError, UnsupportedModelError
from ferrox.multimodal.config_fields import flag, positive_int
from ferrox.multimodal.gemma4_processing import SOFT_TOKEN_CHOICES, aspect_ratio_preserving_size
from ferrox.multimodal.pixel_scaling import PixelScaling
from ferrox.multimodal.qwen2_vl_video_processing import (
    _MODES,
    DEFAULT_FPS,
    VIDEO_PREPROCESSOR_FILE,
    video_processor_fields,
)
from ferrox.multimodal.video import Video

# Gemma4VideoProcessor's class attributes: what a field means when the file leaves it out (or sets it null).
_DEFAULTS: dict[str, Any] = {
    "do_resize": True, "resample": 3, "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
    "image_mean": [0.0, 0.0, 0.0], "image_std": [1.0, 1.0, 1.0], "do_sample_frames": True, "num_frames": 32,
    "patch_size": 16, "max_soft_tokens": 70, "pooling_kernel_size": 3,
}


class Gemma4VideoProcessor:
    """`prepare(video)` -> (float32 [frames, rows * cols, P*P*3] patches, (rows, cols), each frame's seconds)."""

    def __init__(self, config: Mapping[str, Any], where: str = VIDEO_PREPROCESSOR_FILE):
        kind = config.get("video_processor_type")
        if kind is not None and str(kind) != "Gemma4VideoProcessor":
            raise UnsupportedModelError(f"{where}: video_processor_type {kind!r} is not Gemma 4's "
                                        "(Gemma4VideoProcessor)")
        if config.get("fps") is not None:  # transformers takes it beside num_frames (always set) as an error
            raise UnsupportedModelError(f"{where}: fps {config['fps']!r}: ferrox samples Gemma 4 videos by "
                                        "num_frames, as transformers' Gemma4VideoProcessor does")
        fields = {**_DEFAULTS, **{k: v for k, v in config.items() if k in _DEFAULTS and v is not None}}
        self.where = where
        self.do_resize = flag(fields, "do_resize", where)
        if fields["resample"] not in _MODES or isinstance(fields["resample"], bool):
            raise ModelLoadError(f"{where}: resample {fields['resample']!r} is not one ferrox resizes videos by "
                                 "(0 nearest, 2 bilinear, 3 bicubic)")
        self.mode = _MODES[int(fields["resample"])]
        self.scaling = PixelScaling.read(fields, where)
        self.do_sample_frames = flag(fields, "do_sample_frames", where)
        # (null in the file: transformers' sampling keeps every frame)
        self.num_frames = (None if "num_frames" in config and config["num_frames"] is None
                           else positive_int(fields["num_frames"], "num_frames", where))
        self.patch_size = positive_int(fields["patch_size"], "patch_size", where)
        self.pooling_kernel_size = positive_int(fields["pooling_kernel_size"], "pooling_kernel_size", where)
        self.max_soft_tokens = positive_int(fields["max_soft_tokens"], "max_soft_tokens", where)
        if self.max_soft_tokens not in SOFT_TOKEN_CHOICES:  # (transformers refuses the others too)
            raise ModelLoadError(f"{where}: max_soft_tokens must be one of {', '.join(map(str, SOFT_TOKEN_CHOICES))}, "
                                 f"got {self.max_soft_tokens}")

    @classmethod
    def from_model_dir(cls, path: str | os.PathLike[str],
                       overrides: Mapping[str, Any] | None = None) -> Gemma4VideoProcessor | None:
        """transformers' files in its order (processor_config.json's video_processor, video_preprocessor_config.json,
        else the image's preprocessor_config.json); None when the folder has none. overrides: mm_processor_kwargs'
        fields over the file's."""
        found = video_processor_fields(path)
        if found is None:
            return None
        if overrides:
            return cls({**found[0], **overrides}, f"{found[1]} with mm_processor_kwargs")
        return cls(found[0], found[1])

    @property
    def max_patches(self) -> int:
        return self.max_soft_tokens * self.pooling_kernel_size**2

    def tokens(self, grid: tuple[int, int]) -> int:
        """A frame's soft tokens: its patches pooled k x k."""
        return grid[0] * grid[1] // self.pooling_kernel_size**2

    def prepare(self, video: Video) -> tuple[np.ndarray, tuple[int, int], list[float]]:
        """ValueError: a whole video whose frame count is not its metadata's, or frames that fit no size."""
        frames = video.frames
        picked = list(range(len(frames)))
        if video.do_sample_frames and self.do_sample_frames:
            total = len(frames)
            if video.total_frames is not None and total != video.total_frames:
                raise ValueError(f"do_sample_frames: the {total} frames must be the whole video "
                                 f"(total_num_frames {video.total_frames})")
            count = total if self.num_frames is None else min(self.num_frames, total)
            picked = (np.arange(count) * total // count).tolist()
            frames = frames[picked]
        sources = [video.indices[i] for i in picked] if video.indices is not None else picked
        fps = video.fps or DEFAULT_FPS
        patches, grid = self(frames)
        return patches, grid, [i / fps for i in sources]

    def __call__(self, frames: np.ndarray) -> tuple[np.ndarray, tuple[int, int]]:
        """uint8 [T, H, W, 3] -> ([T, rows * cols, P*P*3] patches, (rows, cols)). ValueError: frames that fit
        no size, or without do_resize ones whose sides are not whole pooled patches within the budget."""
        import torch

        x = torch.from_numpy(np.ascontiguousarray(frames)).permute(0, 3, 1, 2).contiguous()
        count, channels, height, width = x.shape
        p, side = self.patch_size, self.patch_size * self.pooling_kernel_size
        if self.do_resize:
            new_h, new_w = aspect_ratio_preserving_size(height, width, p, self.max_patches, self.pooling_kernel_size)
            if (new_h, new_w) != (height, width):
                smooth = self.mode != "nearest-exact"
                x = torch.nn.functional.interpolate(x, size=[new_h, new_w], mode=self.mode,
                                                    align_corners=False if smooth else None, antialias=smooth)
        elif height % side or width % side or (height // p) * (width // p) > self.max_patches:
            raise ValueError(f"{width}x{height} frames: without do_resize their sides must be multiples of {side} "
                             f"(patch_size x pooling_kernel_size) within {self.max_patches} patches")
        values = x.to(torch.float32)
        values = self.scaling.apply_torch(values)
        v = values.numpy()
        rows, cols = v.shape[2] // p, v.shape[3] // p
        # (frame, row, col, row in patch, col in patch, channel): transformers' convert_video_to_patches
        patches = v.reshape(count, channels, rows, p, cols, p).transpose(0, 2, 4, 3, 5, 1)
        patches = patches.reshape(count, rows * cols, p * p * channels)
        return np.ascontiguousarray(patches, dtype=np.float32), (rows, cols)


def timestamp(seconds: float) -> str:
    """Gemma4Processor's `mm:ss`: whole minutes and seconds, two digits each."""
    return f"{int(seconds // 60):02d}:{int(seconds % 60):02d}"


def frame_tokens(tokenizer: Any, seconds: Sequence[float], count: int, boi: int, video: int,
                 eoi: int) -> tuple[list[int], list[int]]:
    """(the tokens a `<|video|>` becomes, where each frame's `count` soft tokens start in them): per frame its
    timestamp text (after a space from the second frame on), begin-of-image, the soft tokens, end-of-image."""
    tokens: list[int] = []
    starts: list[int] = []
    for k, t in enumerate(seconds):
        tokens += tokenizer.encode(f"{' ' if k else ''}{timestamp(t)} ", add_special_tokens=False)
        tokens.append(boi)
        starts.append(len(tokens))
        tokens += [video] * count
        tokens.append(eoi)
    return tokens, starts
