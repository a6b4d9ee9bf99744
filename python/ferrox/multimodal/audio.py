"""Where an audio clip comes from, and the samples the model's feature extractor sees of it.

A clip reaches ferrox as samples (offline: vLLM's `multi_modal_data["audio"]`, a float array at the feature
extractor's rate or `(array, sampling_rate)`) or as an encoded file: a chat's OpenAI part
`{"type": "input_audio", "input_audio": {"data": <base64>, "format": "wav"}}` or vLLM's
`{"type": "audio_url", "audio_url": {"url": ...}}` (a data: URL, http(s) under VLLM_AUDIO_FETCH_TIMEOUT, default
10 s as vLLM's, or a local file under --allowed-local-media-path: the same rules as images, multimodal/media.py).
Files are decoded with PyAV; every clip becomes mono float32 at the extractor's rate (16 kHz for Gemma 4): the
channels averaged (librosa's to_mono, which vLLM's loader uses), then resampled by libswresample (PyAV's
AudioResampler; vLLM resamples with librosa, so a clip at another rate may differ from vLLM's in the last bits;
one already at the rate is taken sample for sample). An input_audio part's `format` must name an audio format;
the bytes are probed, not trusted to it. Errors name the field (the caller prefixes the part): undecodable
bytes, a file without an audio stream, an empty clip, an unknown format.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import io
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ferrox.multimodal.media import (
    MediaError,
    _read_local,
    capped,
    fetch_media_url,
    fetch_timeout,
    read_media_url,
)

TIMEOUT_ENV = "VLLM_AUDIO_FETCH_TIMEOUT"
DEFAULT_TIMEOUT_S = 10.0  # vLLM's default
MAX_AUDIO_BYTES = 64 * 2**20
# input_audio's formats (OpenAI's wav and mp3, and the containers vLLM's loaders read); the bytes are probed.
AUDIO_FORMATS = ("wav", "mp3", "flac", "ogg", "opus", "webm", "m4a", "aac", "mp4")


@dataclass(slots=True)
class AudioSource:
    """A prompt's clip before it is loaded (marks it apart from images and videos in the prompt's media list):
    a chat part's url or base64 data (with its declared format), or what an offline caller passed."""

    source: Any
    format: str | None = None  # an input_audio part's format (its data is then base64, not a url); None otherwise
    where: str | None = None  # a chat part's place (`messages[0].content[1]`), for errors naming its field


@dataclass(slots=True)
class Audio:
    """A decoded clip: mono float32 samples at `rate`."""

    samples: np.ndarray
    rate: int
    _hash: str | None = field(default=None, repr=False)

    @property
    def seconds(self) -> float:
        return len(self.samples) / self.rate

    def hash(self) -> str:
        """sha256 of the rate and the samples: keeps prefix-cache blocks of different clips apart."""
        if self._hash is None:
            digest = hashlib.sha256(f"audio\x00{self.rate}\x00{len(self.samples)}\x00".encode())
            digest.update(np.ascontiguousarray(self.samples, dtype=np.float32).tobytes())
            self._hash = digest.hexdigest()
        return self._hash


def audio_fetch_timeout() -> float:
    """Seconds an http(s) audio fetch may take: $VLLM_AUDIO_FETCH_TIMEOUT, else 10 (vLLM's default)."""
    return fetch_timeout(TIMEOUT_ENV, DEFAULT_TIMEOUT_S)


def audios_of(value: Any) -> list[Any]:
    """vLLM's multi_modal_data["audio"]: one clip (a 1-D array, (array, sampling_rate), bytes, a url or path) or a
    list of them -> a list of clips."""
    if isinstance(value, tuple) and len(value) == 2 and isinstance(value[0], np.ndarray) \
            and isinstance(value[1], (int, float)) and not isinstance(value[1], bool):
        return [value]
    if isinstance(value, np.ndarray) and value.ndim == 2 and value.dtype != object:
        return [value]  # (channels, samples) of one clip: averaged to mono below
    if isinstance(value, (list, tuple)):
        return list(value)
    return [value]


def to_audio(value: Any, rate: int, *, allowed_local_media_path: str | None = None, timeout: float | None = None,
             max_bytes: int = MAX_AUDIO_BYTES) -> Audio:
    """An Audio at `rate` from what an offline caller passes (blocks on a download or a file)."""
    if isinstance(value, Audio):
        return value if value.rate == rate else Audio(resample(value.samples, value.rate, rate), rate)
    if isinstance(value, AudioSource):
        if value.format is not None:
            return decode_audio(input_audio_bytes(value.source, value.format), rate)
        value = value.source
    if isinstance(value, tuple) and len(value) == 2:
        samples, orig = value
        if isinstance(orig, bool) or not isinstance(orig, (int, float)) or not orig > 0:
            raise MediaError(f"an (array, sampling_rate) clip needs a positive sampling rate, got {orig!r}")
        return Audio(resample(_samples(samples), float(orig), rate), rate)
    if isinstance(value, (np.ndarray, list)):
        return Audio(_samples(value), rate)  # (vLLM's rule: a bare array is at the processor's rate)
    if isinstance(value, (bytes, bytearray, memoryview)):
        return decode_audio(capped(bytes(value), max_bytes, "audio"), rate)
    if isinstance(value, os.PathLike):
        return decode_audio(capped(_read_local(os.fspath(value), allowed_local_media_path), max_bytes, "audio"), rate)
    if not isinstance(value, str):
        raise MediaError("an audio clip must be a float array, (array, sampling_rate), bytes, a URL or a path, got "
                         f"{type(value).__name__}")
    return decode_audio(read_media_url(value, what="audio", env=TIMEOUT_ENV, max_bytes=max_bytes,
                                       timeout=timeout if timeout is not None else audio_fetch_timeout(),
                                       allowed_local_media_path=allowed_local_media_path), rate)


async def fetch_audio(source: AudioSource, rate: int, *, allowed_local_media_path: str | None = None,
                      timeout: float | None = None, max_bytes: int = MAX_AUDIO_BYTES) -> Audio:
    """A chat part's clip (server): to_audio's rules, the download on aiohttp and the decode on a thread."""
    if source.format is not None:
        return await asyncio.to_thread(lambda: decode_audio(input_audio_bytes(source.source, source.format), rate))
    url = source.source
    if not isinstance(url, str):
        return await asyncio.to_thread(to_audio, url, rate, allowed_local_media_path=allowed_local_media_path)
    return await fetch_media_url(url, lambda data: decode_audio(data, rate), what="audio", env=TIMEOUT_ENV,
                                 timeout=timeout if timeout is not None else audio_fetch_timeout(),
                                 max_bytes=max_bytes, allowed_local_media_path=allowed_local_media_path)


def input_audio_bytes(data: Any, fmt: Any, max_bytes: int = MAX_AUDIO_BYTES) -> bytes:
    """The bytes of an input_audio part: its format one ferrox decodes, its data base64 (MediaError naming the
    field: `format: ...`, `data: ...`)."""
    if fmt is None or fmt == "":
        raise MediaError(f"format: missing: name the clip's format ({', '.join(AUDIO_FORMATS)})")
    if not isinstance(fmt, str) or fmt.lower() not in AUDIO_FORMATS:
        raise MediaError(f"format: {fmt!r} is not an audio format ferrox decodes ({', '.join(AUDIO_FORMATS)})")
    if not isinstance(data, str) or not data:
        raise MediaError("data: an input_audio part needs its clip as a base64 string")
    if len(data) > (max_bytes * 4) // 3 + 4:
        raise MediaError(f"data: the clip is larger than {max_bytes} bytes")
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as e:
        raise MediaError(f"data: not valid base64: {e}") from None


def decode_audio(data: bytes, rate: int) -> Audio:
    """The mono float32 samples at `rate` of an encoded clip (wav, mp3, flac, ogg...)."""
    import av

    planes: list[np.ndarray] = []
    try:
        with av.open(io.BytesIO(data), mode="r") as container:
            if not container.streams.audio:
                raise MediaError("not decodable audio: the file has no audio stream")
            stream = container.streams.audio[0]
            # Channels kept apart (planar float) and resampled each; averaged afterwards.
            resampler = av.AudioResampler(format="fltp", rate=rate)
            for frame in container.decode(stream):
                planes.extend(out.to_ndarray() for out in resampler.resample(frame))
            planes.extend(out.to_ndarray() for out in resampler.resample(None))
    except MediaError:
        raise
    except Exception as e:  # PyAV raises its own error tree (av.FFmpegError), and ValueError, EOFError...
        raise MediaError(f"not decodable audio: {e}") from None
    if not planes or sum(p.shape[-1] for p in planes) == 0:
        raise MediaError("empty audio: no samples decode")
    samples = np.concatenate(planes, axis=-1)
    return Audio(np.ascontiguousarray(samples.mean(axis=0) if samples.ndim == 2 else samples, dtype=np.float32), rate)


def resample(samples: np.ndarray, orig: float, rate: int) -> np.ndarray:
    """Mono float32 samples from `orig` Hz to `rate` Hz (libswresample); unchanged at the same rate."""
    if float(orig) == float(rate):
        return samples
    if float(orig) != int(orig):
        raise MediaError(f"a sampling rate must be a whole number of Hz to resample, got {orig!r}")
    import av

    frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(samples[None, :], dtype=np.float32), format="flt",
                                       layout="mono")
    frame.sample_rate = int(orig)
    resampler = av.AudioResampler(format="flt", layout="mono", rate=rate)
    parts = [out.to_ndarray()[0] for out in resampler.resample(frame)]
    parts += [out.to_ndarray()[0] for out in resampler.resample(None)]
    return np.ascontiguousarray(np.concatenate(parts) if parts else np.zeros(0), dtype=np.float32)


def _samples(value: Any) -> np.ndarray:
    """Mono float32 samples from a 1-D array (or list), or a (channels, samples) array averaged over channels."""
    array = np.asarray(value)
    if array.dtype.kind not in "fi":
        raise MediaError(f"audio samples must be floats (or signed PCM integers), got {array.dtype}")
    if array.ndim == 2:
        array = array.mean(axis=0)
    if array.ndim != 1:
        raise MediaError(f"audio samples must be 1-D (or [channels, samples]), got shape {list(array.shape)}")
    if array.dtype.kind == "i":  # PCM integers: scaled to [-1, 1) as a decoder does
        array = array / float(np.iinfo(array.dtype).max + 1)
    if not np.isfinite(array).all():
        raise MediaError("audio samples must be finite (no NaN or inf)")
    return np.ascontiguousarray(array, dtype=np.float32)


def load_audio_source(prompts: Any, source: Any, what: str, param: str = "multi_modal_data") -> Audio:
    """The Audio of an offline prompt's AudioSource at the model's rate (its --allowed-local-media-path), or
    InvalidArgumentError naming `what`."""
    from ferrox.errors import InvalidArgumentError

    rate = prompts.audio_processor.sampling_rate
    try:
        return to_audio(source, rate, allowed_local_media_path=prompts.allowed_local_media_path)
    except MediaError as e:
        if isinstance(source, AudioSource) and source.where is not None:  # a chat part: its field named
            raise InvalidArgumentError(part_error(source.where, source, e), param="messages") from None
        raise InvalidArgumentError(f"{what}: {e}", param=param) from None


def is_audio(item: Any) -> bool:
    return isinstance(item, (AudioSource, Audio))


def part_source(part: Mapping[str, Any], where: str) -> AudioSource:
    """The AudioSource of a chat's input_audio or audio_url part (vLLM also takes the url as a plain string);
    its data and format are checked as it decodes, once the model is known to take audio."""
    if part.get("type") == "input_audio":
        body = part.get("input_audio")
        if not isinstance(body, Mapping):
            raise MediaError(f"{where}.input_audio: must be an object {{\"data\": <base64>, \"format\": \"wav\"}}")
        return AudioSource(body.get("data"), body.get("format") or "", where)
    url = part.get("audio_url")
    if isinstance(url, Mapping):
        url = url.get("url")
    if not isinstance(url, str) or not url:
        raise MediaError(f"{where}.audio_url.url: an audio part needs a url (https://..., data:audio/wav;base64,...)")
    return AudioSource(url, None, where)


def part_error(where: str, source: AudioSource, error: Exception) -> str:
    """A clip's MediaError prefixed with its part's field: `...input_audio.data: ...`, `...audio_url.url: ...`."""
    message = str(error)
    if source.format is None:
        return f"{where}.audio_url.url: {message}"
    if message.startswith(("format: ", "data: ")):
        return f"{where}.input_audio.{message}"
    return f"{where}.input_audio.data: {message}"
