"""vLLM's media loader arguments: `--media-io-kwargs` (the server's, a JSON object keyed by modality) and a chat
request's `media_io_kwargs` (merged over the server's, modality by modality, as vLLM merges them).

The keys are those of vLLM's default loaders that ferrox's decoders honour:
- video `num_frames` (default 32): the frames kept of a video file, spread evenly from the first to the last;
  -1 (or 0) keeps every frame, which Qwen-VL processors then sample by their own fps (Qwen's recipe for
  Qwen3-VL: `--media-io-kwargs '{"video": {"num_frames": -1}}'` with mm_processor_kwargs fps);
- video `fps` (default -1, off): at most floor(duration * fps) frames, still spread evenly;
- image `image_mode`: "RGB" only (ferrox's image processors take RGB).
Any other key or modality is refused by name (`media_io_kwargs.video.frame_recovery: ...`)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from ferrox.errors import InvalidArgumentError

NUM_FRAMES = 32  # frames vLLM's video loader keeps of a file


@dataclass(frozen=True, slots=True)
class MediaIOOptions:
    num_frames: int = NUM_FRAMES  # video: frames kept (<= 0: all)
    fps: float = -1.0  # video: at most duration * fps frames (<= 0: no cap)


def parse_media_io_kwargs(raw: Any, base: MediaIOOptions | None = None, *,
                          field: str = "media_io_kwargs") -> MediaIOOptions:
    """`raw` over `base` (the defaults when None); InvalidArgumentError naming field.modality.key."""
    options = base or MediaIOOptions()
    if raw is None:
        return options
    if not isinstance(raw, dict):
        raise InvalidArgumentError(f"{field}: must be a JSON object keyed by modality, got {raw!r}", param=field)
    for modality, kwargs in raw.items():
        where = f"{field}.{modality}"
        if modality not in ("image", "video"):
            raise InvalidArgumentError(f"{where}: ferrox takes images and videos only", param=field)
        if not isinstance(kwargs, dict):
            raise InvalidArgumentError(f"{where}: must be a JSON object, got {kwargs!r}", param=field)
        for key, value in kwargs.items():
            if modality == "image" and key == "image_mode":
                if value != "RGB":
                    raise InvalidArgumentError(f"{where}.image_mode: only \"RGB\" (ferrox's image processors take "
                                               f"RGB), got {value!r}", param=field)
            elif modality == "video" and key == "num_frames":
                if isinstance(value, bool) or not isinstance(value, int):
                    raise InvalidArgumentError(f"{where}.num_frames: must be an integer (-1: every frame), got "
                                               f"{value!r}", param=field)
                options = replace(options, num_frames=value)
            elif modality == "video" and key == "fps":
                if isinstance(value, bool) or not isinstance(value, (int, float)):
                    raise InvalidArgumentError(f"{where}.fps: must be a number (-1: no cap), got {value!r}",
                                               param=field)
                options = replace(options, fps=float(value))
            else:
                known = "image_mode" if modality == "image" else "num_frames, fps"
                raise InvalidArgumentError(f"{where}.{key}: not a {modality} loader argument ferrox has "
                                           f"(known: {known})", param=field)
    return options
