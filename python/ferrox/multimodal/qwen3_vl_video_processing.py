"""Qwen3-VL videos: which frames, their patches, and the timestamp written before each temporal patch.

What vLLM and transformers 5 do together. vLLM's loader keeps NUM_FRAMES frames of a file and marks the video
`do_sample_frames` only when it kept every frame (a short file); offline (frames, metadata) carry the flag
themselves (default off). Qwen3-VL needs the metadata: without fps and frames_indices no timestamp can be
written, and vLLM refuses such a video. Then transformers' Qwen3VLVideoProcessor:

- frames: when do_sample_frames, again `int(total / fps * processor fps)` of them (clamped to [min_frames,
  max_frames] and the total), spread evenly and rounded; otherwise the frames as given;
- size: one size for every frame, chosen over the whole clip (area x frames within [shortest_edge,
  longest_edge] of `size`: the top-level min_pixels / max_pixels it does not read), sides multiples of
  patch x merge (32); at least temporal_patch_size frames;
- values and patches: Qwen2-VL's (qwen2_vl_video_processing.py), with IMAGENET_STANDARD 0.5 mean / std;
- timestamps: each temporal patch's seconds, the mean of its first and last frame's `index / fps`
  (the last patch's missing frames repeat the last index), written `<{t:.1f} seconds>`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from ferrox.errors import ModelLoadError
from ferrox.multimodal.config_fields import positive_int
from ferrox.multimodal.qwen2_vl_processing import MAX_ASPECT_RATIO
from ferrox.multimodal.qwen2_vl_video_processing import VIDEO_PREPROCESSOR_FILE, QwenVLVideoProcessor
from ferrox.multimodal.video import Video

# Qwen3VLVideoProcessor's class attributes where they differ from Qwen2-VL's video processor.
_DEFAULTS: dict[str, Any] = {
    "size": {"shortest_edge": 128 * 32 * 32, "longest_edge": 32 * 32 * 768}, "patch_size": 16,
    "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "max_video_tokens": 768,
}
_SAMPLING = {"fps": 2, "min_frames": 4, "max_frames": 768}


class Qwen3VLVideoProcessor(QwenVLVideoProcessor):
    """`prepare(video)` -> (patches, (grid_t, grid_h, grid_w), seconds of each temporal patch)."""

    def __init__(self, config: Mapping[str, Any], where: str = VIDEO_PREPROCESSOR_FILE):
        # transformers' Qwen3-VL video processor reads `size` only; do_sample_frames is vLLM's per video.
        fields = {**_DEFAULTS, **{k: v for k, v in config.items()
                                  if k not in ("min_pixels", "max_pixels", "do_sample_frames") and v is not None}}
        super().__init__(fields, where)
        if config.get("num_frames") is not None:  # transformers refuses it beside the fps it always has
            raise ModelLoadError(f"{where}: num_frames {config['num_frames']!r}: Qwen3-VL samples frames by fps "
                                 "(transformers takes num_frames and fps together as an error)")
        sampling = {**_SAMPLING, **{k: v for k, v in config.items() if k in _SAMPLING and v is not None}}
        fps = sampling["fps"]
        if isinstance(fps, bool) or not isinstance(fps, (int, float)) or fps <= 0:
            raise ModelLoadError(f"{where}: fps must be a positive number, got {fps!r}")
        self.fps = float(fps)
        self.min_frames = positive_int(sampling["min_frames"], "min_frames", where)
        self.max_frames = positive_int(sampling["max_frames"], "max_frames", where)

    def prepare(self, video: Video) -> tuple[np.ndarray, tuple[int, int, int], list[float]]:
        """ValueError: a video without its metadata, too few frames, or frames smart_resize refuses."""
        if video.fps is None or video.indices is None or video.total_frames is None:
            raise ValueError("Qwen3-VL writes each frame's timestamp in the prompt, so a video needs its metadata: "
                             "pass (frames, {'fps', 'total_num_frames', 'frames_indices'}) or a video file")
        frames, indices = video.frames, video.indices
        if video.do_sample_frames:
            if len(frames) != video.total_frames:
                raise ValueError(f"do_sample_frames: the {len(frames)} frames must be the whole video "
                                 f"(total_num_frames {video.total_frames})")
            count = int(video.total_frames / video.fps * self.fps)
            count = min(max(count, self.min_frames), self.max_frames, video.total_frames)
            indices = np.linspace(0, video.total_frames - 1, count).round().astype(int).tolist()
            frames = frames[indices]
        patches, grid = self(Video(frames))
        return patches, grid, self.timestamps(indices, video.fps)

    def timestamps(self, indices: list[int], fps: float) -> list[float]:
        tp = self.temporal_patch_size
        padded = list(indices) + [indices[-1]] * (-len(indices) % tp)
        return [(padded[i] / fps + padded[i + tp - 1] / fps) / 2 for i in range(0, len(padded), tp)]

    def _resize(self, frames: Any, factor: int) -> Any:
        import torch

        count, _, height, width = frames.shape
        if count < self.temporal_patch_size:
            raise ValueError(f"{count} frame(s): a Qwen3-VL video needs at least {self.temporal_patch_size}")
        max_pixels = self.max_pixels
        if self.cap_pixels_per_frame:  # qwen-vl-utils' per-frame bound, times the frames
            per_frame = max(min(self.max_video_tokens * factor * factor, self.max_pixels // count),
                            int(self.min_pixels * 1.05))
            max_pixels = per_frame * count
        new_h, new_w = clip_resize(count, height, width, self.temporal_patch_size, factor, self.min_pixels,
                                   max_pixels)
        if (new_h, new_w) == (height, width):
            return frames
        smooth = self.mode != "nearest-exact"
        return torch.nn.functional.interpolate(frames, size=[new_h, new_w], mode=self.mode,
                                               align_corners=False if smooth else None, antialias=smooth)


def clip_resize(count: int, height: int, width: int, temporal: int, factor: int, min_pixels: int,
                max_pixels: int) -> tuple[int, int]:
    """transformers' Qwen3-VL smart_resize: Qwen2-VL's rule with the area counted over the clip's frames (and
    frames under `factor` a side first scaled up to it)."""
    import math

    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ValueError(f"{width}x{height} frames are too long: the aspect ratio must be at most {MAX_ASPECT_RATIO}")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    t_bar = round(count / temporal) * temporal
    if t_bar * h_bar * w_bar > max_pixels:
        beta = math.sqrt(count * height * width / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif t_bar * h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (count * height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar
