"""Qwen2-VL and Qwen2.5-VL videos: their patches and the seconds between temporal patches.

transformers' Qwen2VLVideoProcessor, which vLLM runs on the frames its loader picked (no further frame
sampling: do_sample_frames is off by default): every frame is resized to one size, smart_resize of the
frame with the video's own min/max pixels (a larger floor and a smaller ceiling than images), by
torchvision on uint8 tensors (bicubic with antialiasing by default, so the resize runs in torch here, not
PIL); rescale and normalize fused into one (x - mean/r) / (std/r) in float32; the frames padded to a
multiple of temporal_patch_size by repeating the last; then cut into [grid_t * grid_h * grid_w, C*T*P*P]
patches, T consecutive frames per temporal patch, merge squares row-major as for images.

Which fields: processor_config.json's video_processor, else video_preprocessor_config.json, else
preprocessor_config.json (transformers' order: a hub Qwen2-VL folder has only the last, so its videos take
the image processor's min/max pixels). Qwen2.5-VL spaces a video's temporal rotary positions by
second_per_grid_ts = temporal_patch_size / the frames' sampled fps (24 when the frames come without one,
as transformers' VideoMetadata assumes).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import numpy as np

from ferrox.errors import ModelLoadError
from ferrox.multimodal.config_fields import (
    PREPROCESSOR_FILE,
    PROCESSOR_FILE,
    flag,
    positive_int,
    read_json_object,
)
from ferrox.multimodal.pixel_scaling import PixelScaling
from ferrox.multimodal.qwen2_vl_processing import _pixel_bounds, smart_resize
from ferrox.multimodal.video import Video

VIDEO_PREPROCESSOR_FILE = "video_preprocessor_config.json"
DEFAULT_FPS = 24.0  # transformers' VideoMetadata.sampled_fps for frames without a frame rate
# Qwen2VLVideoProcessor's class attributes: what a field means when the file leaves it out.
_DEFAULTS: dict[str, Any] = {
    "do_resize": True, "resample": 3, "size": {"shortest_edge": 128 * 28 * 28, "longest_edge": 28 * 28 * 768},
    "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
    "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711],
    "patch_size": 14, "temporal_patch_size": 2, "merge_size": 2, "do_sample_frames": False,
    "cap_pixels_per_frame": False, "max_video_tokens": 128_000,
}
# PIL filter number -> torch interpolate mode, as transformers maps them for torchvision.
_MODES = {0: "nearest-exact", 2: "bilinear", 3: "bicubic"}


def video_processor_fields(path: str | os.PathLike[str]) -> tuple[Mapping[str, Any], str] | None:
    """(the video processor's fields, where they were), in transformers' order; None when none is there."""
    nested = read_json_object(os.path.join(path, PROCESSOR_FILE)).get("video_processor")
    if isinstance(nested, Mapping):
        return nested, f"{PROCESSOR_FILE}: video_processor"
    for name in (VIDEO_PREPROCESSOR_FILE, PREPROCESSOR_FILE):
        file = os.path.join(path, name)
        if os.path.isfile(file):
            return read_json_object(file), name
    return None


class QwenVLVideoProcessor:
    """`processor(video)` -> (float32 [grid_t * grid_h * grid_w, C*T*P*P] patches, (grid_t, grid_h, grid_w))."""

    def __init__(self, config: Mapping[str, Any], where: str = VIDEO_PREPROCESSOR_FILE):
        fields = {**_DEFAULTS, **{k: v for k, v in config.items() if k in _DEFAULTS and v is not None}}
        self.where = where
        self.min_pixels, self.max_pixels = _pixel_bounds(config, fields["size"], where)
        self.do_resize = flag(fields, "do_resize", where)
        if fields["resample"] not in _MODES or isinstance(fields["resample"], bool):
            raise ModelLoadError(f"{where}: resample {fields['resample']!r} is not one ferrox resizes videos by "
                                 "(0 nearest, 2 bilinear, 3 bicubic)")
        self.mode = _MODES[int(fields["resample"])]
        self.scaling = PixelScaling.read(fields, where)
        self.patch_size = positive_int(fields["patch_size"], "patch_size", where)
        self.temporal_patch_size = positive_int(fields["temporal_patch_size"], "temporal_patch_size", where)
        self.merge_size = positive_int(fields["merge_size"], "merge_size", where)
        # do_sample_frames: transformers would pick frames again at `fps`; vLLM's loader already picked them.
        self.do_sample_frames = flag(fields, "do_sample_frames", where)
        self.cap_pixels_per_frame = flag(fields, "cap_pixels_per_frame", where)
        self.max_video_tokens = positive_int(fields["max_video_tokens"], "max_video_tokens", where)

    @classmethod
    def from_model_dir(cls, path: str | os.PathLike[str],
                       overrides: Mapping[str, Any] | None = None) -> QwenVLVideoProcessor | None:
        found = video_processor_fields(path)
        if found is None:
            return None
        if overrides:
            return cls({**found[0], **overrides}, f"{found[1]} with mm_processor_kwargs")
        return cls(found[0], found[1])

    def tokens(self, grid: tuple[int, int, int]) -> int:
        return grid[0] * grid[1] * grid[2] // self.merge_size**2

    def second_per_grid_t(self, video: Video) -> float:
        """Seconds one temporal patch spans (Qwen2_5_VLProcessor's second_per_grid_ts)."""
        return self.temporal_patch_size / (video.sampled_fps or DEFAULT_FPS)

    def __call__(self, video: Video) -> tuple[np.ndarray, tuple[int, int, int]]:
        """ValueError: frames smart_resize refuses, or that do_sample_frames would sample again."""
        import torch

        if self.do_sample_frames:
            raise ValueError(f"{self.where} sets do_sample_frames, which ferrox does not do (vLLM's loader picks "
                             "the frames)")
        frames = torch.from_numpy(np.ascontiguousarray(video.frames)).permute(0, 3, 1, 2).contiguous()
        count, channels, height, width = frames.shape
        factor = self.patch_size * self.merge_size
        if self.do_resize:
            frames = self._resize(frames, factor)
        elif height % factor or width % factor:
            raise ValueError(f"{width}x{height} frames: without do_resize their sides must be multiples of "
                             f"{factor} (patch_size x merge_size)")
        values = frames.to(torch.float32)
        values = self.scaling.apply_torch(values)
        return self._patches(values.numpy())

    def _resize(self, frames: Any, factor: int) -> Any:
        import torch

        count, _, height, width = frames.shape
        max_pixels = self.max_pixels
        if self.cap_pixels_per_frame:  # qwen-vl-utils' bound on a whole video's pixels
            total = int(self.max_video_tokens * factor * factor * 0.9)
            max_pixels = max(min(max_pixels, total * self.temporal_patch_size // count), int(self.min_pixels * 1.05))
        new_h, new_w = smart_resize(height, width, factor, self.min_pixels, max_pixels)
        if (new_h, new_w) == (height, width):
            return frames
        smooth = self.mode != "nearest-exact"
        return torch.nn.functional.interpolate(frames, size=[new_h, new_w], mode=self.mode,
                                               align_corners=False if smooth else None, antialias=smooth)

    def _patches(self, values: np.ndarray) -> tuple[np.ndarray, tuple[int, int, int]]:
        """[T, C, H, W] -> [grid_t * grid_h * grid_w, C*tp*P*P], the last frame repeated to fill the last
        temporal patch."""
        count, channels, height, width = values.shape
        p, m, tp = self.patch_size, self.merge_size, self.temporal_patch_size
        if pad := -count % tp:
            values = np.concatenate([values, np.repeat(values[-1:], pad, axis=0)])
            count += pad
        grid_t, grid_h, grid_w = count // tp, height // p, width // p
        blocks = values.reshape(grid_t, tp, channels, grid_h // m, m, p, grid_w // m, m, p)
        # (t, square row, square col, row, col, C, tp, P, P)
        blocks = blocks.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)
        patches = np.ascontiguousarray(blocks.reshape(grid_t * grid_h * grid_w, channels * tp * p * p),
                                       dtype=np.float32)
        return patches, (grid_t, grid_h, grid_w)


def check_tower(processor: QwenVLVideoProcessor, vision: Mapping[str, Any]) -> None:
    """The processor's patch sizes must be the tower's (config.json vision_config)."""
    from ferrox.errors import UnsupportedModelError

    for ours, theirs in (("patch_size", "patch_size"), ("temporal_patch_size", "temporal_patch_size"),
                         ("merge_size", "spatial_merge_size")):
        if getattr(processor, ours) != vision[theirs]:
            raise UnsupportedModelError(f"{processor.where}: {ours} {getattr(processor, ours)} differs from the "
                                        f"vision tower's {theirs} {vision[theirs]} (config.json)")

