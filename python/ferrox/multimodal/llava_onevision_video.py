"""LLaVA-OneVision videos: each frame a tower image, its feature map pooled 2x2, one image_newline after them all.

transformers' LlavaOnevisionVideoProcessor, which vLLM runs on the frames its loader picked (do_sample_frames is
off by default): every frame resized to `size` (the tower's image, 384 x 384) by torchvision on uint8 tensors
(bicubic with antialiasing, so in torch here, as qwen2_vl_video_processing.py does), then rescale and normalize
fused into (x - mean/r) / (std/r) in float32: [frames, 3, S, S] pixels. The model (models/llava_onevision.py)
projects each frame's p x p map, scales it bilinearly to ceil(p/2) x ceil(p/2), lays the frames one after the
other and ends the video with image_newline: LlavaOnevisionProcessor's frames * ceil(p/2)^2 + 1 `<video>` tokens.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from typing import Any

import numpy as np

from ferrox.errors import ModelLoadError, UnsupportedModelError
from ferrox.multimodal.config_fields import flag
from ferrox.multimodal.image_processor import size_dict
from ferrox.multimodal.pixel_scaling import PixelScaling
from ferrox.multimodal.qwen2_vl_video_processing import (
    _MODES,
    VIDEO_PREPROCESSOR_FILE,
    video_processor_fields,
)
from ferrox.multimodal.video import Video

# LlavaOnevisionVideoProcessor's class attributes: what a field means when the file leaves it out.
_DEFAULTS: dict[str, Any] = {
    "do_resize": True, "resample": 3, "size": {"height": 384, "width": 384}, "do_rescale": True,
    "rescale_factor": 1 / 255, "do_normalize": True, "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711], "do_center_crop": False, "do_sample_frames": False,
}


def pooled_side(patches: int) -> int:
    """A frame's feature map side after OneVision's 2x2 pooling (transformers' apply_pooling: rounded up)."""
    return math.ceil(patches / 2)


class LlavaOnevisionVideoProcessor:
    """`processor(video)` -> (float32 [frames, 3, S, S] pixels, (frames, S, S))."""

    def __init__(self, config: Mapping[str, Any], tile: int, patches: int, where: str = VIDEO_PREPROCESSOR_FILE):
        fields = {**_DEFAULTS, **{k: v for k, v in config.items() if k in _DEFAULTS and v is not None}}
        self.where = where
        self.do_resize = flag(fields, "do_resize", where)
        if fields["resample"] not in _MODES or isinstance(fields["resample"], bool):
            raise ModelLoadError(f"{where}: resample {fields['resample']!r} is not one ferrox resizes videos by "
                                 "(0 nearest, 2 bilinear, 3 bicubic)")
        self.mode = _MODES[int(fields["resample"])]
        size = size_dict(fields["size"], "size", square=False)
        if flag(fields, "do_center_crop", where) or size != {"height": tile, "width": tile}:
            raise UnsupportedModelError(f"{where}: size {size}, do_center_crop {fields['do_center_crop']}: ferrox "
                                        f"takes LLaVA-OneVision videos resized to the tower's {tile} x {tile}")
        self.tile, self.patches = tile, patches
        self.scaling = PixelScaling.read(fields, where)
        # do_sample_frames: transformers would pick frames again; vLLM's loader already picked them.
        self.do_sample_frames = flag(fields, "do_sample_frames", where)

    @classmethod
    def from_model_dir(cls, path: str | os.PathLike[str], tile: int,
                       patches: int) -> LlavaOnevisionVideoProcessor | None:
        found = video_processor_fields(path)
        return cls(found[0], tile, patches, found[1]) if found is not None else None

    def tokens(self, grid: tuple[int, int, int]) -> int:
        return grid[0] * pooled_side(self.patches) ** 2 + 1

    def __call__(self, video: Video) -> tuple[np.ndarray, tuple[int, int, int]]:
        """ValueError: frames that do_sample_frames would sample again, or of another size without do_resize."""
        import torch

        if self.do_sample_frames:
            raise ValueError(f"{self.where} sets do_sample_frames, which ferrox does not do (vLLM's loader picks "
                             "the frames)")
        frames = torch.from_numpy(np.ascontiguousarray(video.frames)).permute(0, 3, 1, 2).contiguous()
        if tuple(frames.shape[2:]) != (self.tile, self.tile):
            if not self.do_resize:
                raise ValueError(f"{frames.shape[3]}x{frames.shape[2]} frames: without do_resize they must be "
                                 f"{self.tile}x{self.tile}")
            smooth = self.mode != "nearest-exact"
            frames = torch.nn.functional.interpolate(frames, size=[self.tile, self.tile], mode=self.mode,
                                                     align_corners=False if smooth else None, antialias=smooth)
        values = frames.to(torch.float32)
        values = self.scaling.apply_torch(values)
        pixels = np.ascontiguousarray(values.numpy(), dtype=np.float32)
        return pixels, (pixels.shape[0], self.tile, self.tile)
