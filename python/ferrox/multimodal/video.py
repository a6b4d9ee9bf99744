"""Where a video comes from, and the frames the model sees of it.

A video reaches ferrox as decoded frames (offline: a uint8 [T, H, W, 3] array or a list of PIL images,
optionally with vLLM's metadata dict beside it) or as an encoded file (a chat's `video_url` part: data:
URL, http(s) under VLLM_VIDEO_FETCH_TIMEOUT, default 30 s, or a local file under
--allowed-local-media-path; the same rules as images, multimodal/media.py). A file is decoded with PyAV
and, as vLLM's loader does, `NUM_FRAMES` frames are picked uniformly over the whole video (every frame
when it has fewer; --media-io-kwargs / a request's media_io_kwargs set the count and an fps cap:
media_io_config.py); the container's frame rate and the picked indices stay with the frames, since
Qwen2.5-VL's rotary positions count seconds (multimodal/qwen2_vl_processing.py).
"""

from __future__ import annotations

import hashlib
import io
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ferrox.errors import InvalidArgumentError
from ferrox.media_io_config import NUM_FRAMES, MediaIOOptions
from ferrox.multimodal.media import (
    MediaError,
    _read_local,
    capped,
    fetch_media_url,
    fetch_timeout,
    read_media_url,
)

TIMEOUT_ENV = "VLLM_VIDEO_FETCH_TIMEOUT"
DEFAULT_TIMEOUT_S = 30.0  # vLLM's default
MAX_VIDEO_BYTES = 256 * 2**20


@dataclass(slots=True)
class VideoSource:
    """A prompt's video before it is loaded: marks it apart from the images in the prompt's media list."""

    source: Any


@dataclass(slots=True)
class Video:
    """Decoded frames, uint8 [T, H, W, 3], and what is known of the file they came from."""

    frames: np.ndarray
    fps: float | None = None  # the source's frame rate
    total_frames: int | None = None  # frames in the source (frames were picked from these)
    indices: list[int] | None = None  # the source frame of each of `frames`
    # vLLM's metadata flag: the frames are the whole video (its loader kept every frame), for a processor that
    # samples again (Qwen3-VL's, at its fps) to pick from. Processors that never resample ignore it.
    do_sample_frames: bool = False
    _hash: str | None = field(default=None, repr=False)

    @property
    def sampled_fps(self) -> float | None:
        """Frames kept per second of video (transformers' VideoMetadata.sampled_fps), None when unknown."""
        if self.fps is None:
            return None
        if self.indices is None or not self.total_frames:
            return self.fps
        return len(self.indices) / self.total_frames * self.fps

    def hash(self) -> str:
        """sha256 of the frames and the frame rate: keeps prefix-cache blocks of different videos apart."""
        if self._hash is None:
            digest = hashlib.sha256(f"video\x00{list(self.frames.shape)}\x00{self.sampled_fps}\x00"
                                    f"{self.do_sample_frames}\x00".encode())
            digest.update(np.ascontiguousarray(self.frames).tobytes())
            self._hash = digest.hexdigest()
        return self._hash


def video_fetch_timeout() -> float:
    """Seconds an http(s) video fetch may take: $VLLM_VIDEO_FETCH_TIMEOUT, else 30 (vLLM's default)."""
    return fetch_timeout(TIMEOUT_ENV, DEFAULT_TIMEOUT_S)


def videos_of(value: Any) -> list[Any]:
    """vLLM's multi_modal_data["video"]: one video (frames, a list of PIL frames, (frames, metadata), a url
    or path) or a list of them -> a list of videos."""
    if isinstance(value, np.ndarray):
        return [value] if value.ndim == 4 else list(value) if value.ndim == 5 else [value]
    if isinstance(value, tuple) and len(value) == 2 and isinstance(value[1], Mapping):
        return [value]  # (frames, metadata)
    if isinstance(value, (list, tuple)):
        if value and _is_frame(value[0]):
            return [value]  # one video as a list of frames
        return list(value)
    return [value]


def _is_frame(value: Any) -> bool:
    from PIL import Image

    return isinstance(value, Image.Image) or (isinstance(value, np.ndarray) and value.ndim == 3)


def to_video(value: Any, *, allowed_local_media_path: str | None = None, timeout: float | None = None,
             max_bytes: int = MAX_VIDEO_BYTES, media_io: MediaIOOptions | None = None) -> Video:
    """A Video from what an offline caller passes (blocks on a download or a file); media_io: how a file is
    sampled (decoded frames are taken as given)."""
    if isinstance(value, Video):
        return value
    if isinstance(value, tuple) and len(value) == 2 and isinstance(value[1], Mapping):
        return _with_metadata(frames_array(value[0]), value[1])
    if isinstance(value, (np.ndarray, list)):
        return Video(frames_array(value))
    if isinstance(value, (bytes, bytearray, memoryview)):
        return decode_video(capped(bytes(value), max_bytes, "video"), media_io)
    if isinstance(value, os.PathLike):
        return decode_video(capped(_read_local(os.fspath(value), allowed_local_media_path), max_bytes, "video"), media_io)
    if not isinstance(value, str):
        raise MediaError("a video must be uint8 frames [T, H, W, 3], a list of PIL images, (frames, metadata), "
                         f"bytes, a URL or a path, got {type(value).__name__}")
    data = read_media_url(value, what="video", env=TIMEOUT_ENV, max_bytes=max_bytes,
                          timeout=timeout if timeout is not None else video_fetch_timeout(),
                          allowed_local_media_path=allowed_local_media_path)
    return decode_video(data, media_io)


async def fetch_video(url: str, *, allowed_local_media_path: str | None = None, timeout: float | None = None,
                      max_bytes: int = MAX_VIDEO_BYTES, media_io: MediaIOOptions | None = None) -> Video:
    """The video at `url` (server): to_video's rules, the download on aiohttp and the decode on a thread."""
    if not isinstance(url, str):
        raise MediaError(f"a video URL must be a string, got {type(url).__name__}")
    return await fetch_media_url(url, lambda data: decode_video(data, media_io), what="video", env=TIMEOUT_ENV,
                                 timeout=timeout if timeout is not None else video_fetch_timeout(),
                                 max_bytes=max_bytes, allowed_local_media_path=allowed_local_media_path)


def frames_array(frames: Any) -> np.ndarray:
    """uint8 [T, H, W, 3] from an array or a list of PIL images / HWC arrays (PIL frames made RGB)."""
    from PIL import Image

    if isinstance(frames, (list, tuple)):
        if not frames:
            raise MediaError("a video needs at least one frame")
        frames = [np.asarray(f.convert("RGB") if isinstance(f, Image.Image) else f) for f in frames]
        if len({f.shape for f in frames}) != 1:
            raise MediaError("a video's frames must all have one size")
        frames = np.stack(frames)
    if not isinstance(frames, np.ndarray):
        raise MediaError(f"video frames must be a numpy array or a list of images, got {type(frames).__name__}")
    if frames.ndim != 4 or frames.shape[-1] != 3 or frames.shape[0] < 1:
        raise MediaError(f"video frames must be [T, H, W, 3] (RGB), got shape {list(frames.shape)}")
    if frames.dtype != np.uint8:
        raise MediaError(f"video frames must be uint8, got {frames.dtype}")
    return frames


def _with_metadata(frames: np.ndarray, metadata: Mapping[str, Any]) -> Video:
    """vLLM's (frames, metadata): fps, total_num_frames and frames_indices say where the frames came from."""
    fps = metadata.get("fps")
    total = metadata.get("total_num_frames")
    indices = metadata.get("frames_indices")
    resample = metadata.get("do_sample_frames", False)
    if not isinstance(resample, bool):
        raise MediaError(f"video metadata do_sample_frames must be true or false, got {resample!r}")
    if fps is not None and (isinstance(fps, bool) or not isinstance(fps, (int, float)) or fps <= 0):
        raise MediaError(f"video metadata fps must be a positive number, got {fps!r}")
    if indices is not None and len(indices) != len(frames):
        raise MediaError(f"video metadata frames_indices has {len(indices)} entries for {len(frames)} frames")
    return Video(frames, float(fps) if fps is not None else None, int(total) if total is not None else None,
                 [int(i) for i in indices] if indices is not None else None, resample)


def sample_indices(total: int, num_frames: int = NUM_FRAMES, fps: float = -1.0, rate: float | None = None) -> list[int]:
    """vLLM's pick: `num_frames` (<= 0: all) indices spread evenly from the first frame to the last (all when
    fewer), and with fps > 0 at most floor(duration * fps) of them (duration = total / rate), at least one."""
    count = min(num_frames, total) if num_frames > 0 else total
    if fps > 0:
        duration = total / rate if rate else 0.0
        count = min(count, int(duration * fps))
    count = max(1, count)
    if count == total:
        return list(range(total))
    return np.linspace(0, total - 1, count, dtype=int).tolist()


def decode_video(data: bytes, options: MediaIOOptions | None = None) -> Video:
    """The sampled RGB frames of an encoded video (mp4, webm, ...), with its frame rate. options: the loader's
    num_frames and fps (media_io_config.py; vLLM's defaults when None)."""
    options = options or MediaIOOptions()
    import av

    try:
        with av.open(io.BytesIO(data), mode="r") as container:
            if not container.streams.video:
                raise MediaError("not a decodable video: the file has no video stream")
            stream = container.streams.video[0]
            rate = stream.average_rate or stream.guessed_rate
            # The header's frame count is not always there (webm) nor right: count what decodes.
            total = 0
            for _ in container.decode(stream):  # counted one at a time: a long video never sits in memory
                total += 1
        if total == 0:
            raise MediaError("not a decodable video: no frames decode")
        wanted = sample_indices(total, options.num_frames, options.fps, float(rate) if rate else None)
        keep = set(wanted)
        frames: list[np.ndarray] = []
        with av.open(io.BytesIO(data), mode="r") as container:
            for i, frame in enumerate(container.decode(container.streams.video[0])):
                if i in keep:
                    frames.append(frame.to_ndarray(format="rgb24"))
    except MediaError:
        raise
    except Exception as e:  # PyAV raises its own error tree (av.FFmpegError), and ValueError, EOFError...
        raise MediaError(f"not a decodable video: {e}") from None
    if len(frames) != len(wanted):
        raise MediaError(f"not a decodable video: {len(frames)} of its {len(wanted)} sampled frames decoded")
    # vLLM's loader marks a video it kept whole for the processor to sample (its do_sample_frames)
    return Video(np.stack(frames), float(rate) if rate else None, total, wanted, len(wanted) == total)


def load_video_source(prompts: Any, source: Any, what: str, param: str = "multi_modal_data") -> Video:
    """The Video of an offline prompt's VideoSource (the model's --allowed-local-media-path), or
    InvalidArgumentError naming `what`."""
    try:
        return to_video(source.source if isinstance(source, VideoSource) else source,
                        allowed_local_media_path=prompts.allowed_local_media_path, media_io=prompts.media_io)
    except MediaError as e:
        raise InvalidArgumentError(f"{what}: {e}", param=param) from None


def split_media(media: Sequence[Any]) -> tuple[list[Any], list[Any]]:
    """(images, videos) of a prompt's media list, each in prompt order (its audio clips are neither: audio.py)."""
    from ferrox.multimodal.audio import is_audio

    videos = [m for m in media if isinstance(m, (VideoSource, Video))]
    images = [m for m in media if not isinstance(m, (VideoSource, Video)) and not is_audio(m)]
    return images, videos
