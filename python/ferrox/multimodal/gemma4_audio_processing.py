"""Gemma 4 audio: a clip's log-mel features, its soft-token count, and what its `<|audio|>` becomes in the prompt.

transformers' Gemma4AudioFeatureExtractor, for one mono float32 clip at sampling_rate (16 kHz): frame_length
(20 ms: 320 samples) windows every hop_length (10 ms: 160), "semicausal": frame_length // 2 zeros before the
clip, each frame frame_length + 1 samples (the extra one for HTK preemphasis, which is off by default); a
periodic Hann window, |rfft| at the next power of two (512; twice that with fft_overdrive), an HTK mel filter
bank (feature_size 128 bins, min_frequency..max_frequency, unnormalized), log(mel + mel_floor), optional per-bin
mean / stddev. Only frames whose whole window is real audio count (transformers zeroes and masks the rest of
its padded batch): (samples - 1) // hop frames for a 16 kHz clip, and no padding is computed at all here.

Gemma4Processor writes each `<|audio|>` as begin-of-audio, the clip's soft tokens and end-of-audio; the count is
the tower's: the two stride-2 convolutions over the frames (ceil(ceil(frames / 2) / 2): one token per 40 ms,
audio_ms_per_token), at most audio_seq_length (750). A clip longer than that allows (audio_seq_length x
audio_ms_per_token: 30 s) is refused by name: transformers' extractor cuts every clip at 30 s and vLLM passes
such a clip on with a warning, which would answer about part of it silently; split it into clips instead.
A run of audio tokens between begin and end of audio whose length is the clip's count is that clip already
expanded (prompt ids from the processor) and stays as it is.

The extractor's fields come from processor_config.json's feature_extractor (transformers 5), else a
preprocessor_config.json naming Gemma4AudioFeatureExtractor; audio_seq_length and audio_ms_per_token from
processor_config.json (Gemma4Processor's defaults otherwise). dither (random noise) is refused by name: ferrox's
features are deterministic, so a repeated clip keeps its prefix-cache blocks. numpy only (the front-end).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ferrox.errors import InvalidArgumentError, ModelLoadError, UnsupportedModelError
from ferrox.multimodal.config_fields import (
    PREPROCESSOR_FILE,
    PROCESSOR_FILE,
    flag,
    number,
    positive_int,
    read_json_object,
)
from ferrox.multimodal.inputs import MultiModalItem

AUDIO_MODALITY = "audio"
# Gemma4Config's token ids (the released tokenizer's `<|audio|>`, `<|audio>`, `<audio|>`).
DEFAULT_AUDIO_TOKEN_ID = 258_881
DEFAULT_BOA_TOKEN_ID = 256_000
DEFAULT_EOA_TOKEN_ID = 258_883
AUDIO_FAMILIES = "Gemma 4 checkpoints with an audio tower (E2B, E4B), Qwen2-Audio and Voxtral"

# Gemma4AudioFeatureExtractor's defaults, and Gemma4Processor's audio fields.
_DEFAULTS: dict[str, Any] = {
    "feature_size": 128, "sampling_rate": 16_000, "frame_length_ms": 20.0, "hop_length_ms": 10.0,
    "min_frequency": 0.0, "max_frequency": 8000.0, "preemphasis": 0.0, "preemphasis_htk_flavor": True,
    "fft_overdrive": False, "dither": 0.0, "input_scale_factor": 1.0, "mel_floor": 1e-3, "per_bin_mean": None,
    "per_bin_stddev": None,
}
_PROCESSOR_DEFAULTS = {"audio_seq_length": 750, "audio_ms_per_token": 40}


def htk_mel_filters(bins: int, filters: int, low: float, high: float, rate: int) -> np.ndarray:
    """[bins, filters] float64 triangular filters, HTK mel scale, unnormalized (transformers' mel_filter_bank with
    norm None, mel_scale "htk": triangles over the FFT bins' frequencies in Hz)."""
    def to_mel(hz: Any) -> Any:
        return 2595.0 * np.log10(1.0 + hz / 700.0)

    mels = np.linspace(to_mel(low), to_mel(high), filters + 2)
    centers = 700.0 * (np.power(10, mels / 2595.0) - 1.0)
    freqs = np.linspace(0, rate // 2, bins)
    widths = np.diff(centers)
    slopes = centers[None, :] - freqs[:, None]
    down = -slopes[:, :-2] / widths[:-1]
    up = slopes[:, 2:] / widths[1:]
    return np.maximum(np.zeros(1), np.minimum(down, up))


class Gemma4AudioFeatureExtractor:
    """`extractor.features(audio)` -> float32 [frames, feature_size] for one clip (multimodal/audio.py Audio at
    sampling_rate); `tokens(frames)` its soft tokens."""

    def __init__(self, config: Mapping[str, Any], where: str = f"{PROCESSOR_FILE}: feature_extractor", *,
                 audio_seq_length: int = 750, audio_ms_per_token: int = 40):
        kind = config.get("feature_extractor_type")
        if kind is not None and str(kind) != "Gemma4AudioFeatureExtractor":
            raise UnsupportedModelError(f"{where}: feature_extractor_type {kind!r} is not Gemma 4's "
                                        "(Gemma4AudioFeatureExtractor)")
        fields = {**_DEFAULTS, **{k: v for k, v in config.items() if k in _DEFAULTS and v is not None}}
        self.where = where
        self.feature_size = positive_int(fields["feature_size"], "feature_size", where)
        self.sampling_rate = positive_int(fields["sampling_rate"], "sampling_rate", where)
        self.frame_length = int(round(self.sampling_rate * number(fields["frame_length_ms"], "frame_length_ms",
                                                                  where) / 1000.0))
        self.hop_length = int(round(self.sampling_rate * number(fields["hop_length_ms"], "hop_length_ms", where)
                                    / 1000.0))
        if self.frame_length < 1 or self.hop_length < 1:
            raise ModelLoadError(f"{where}: frame_length_ms and hop_length_ms must each span at least one sample")
        if number(fields["dither"], "dither", where) != 0.0:
            raise ModelLoadError(f"{where}: dither {fields['dither']!r}: ferrox computes deterministic features "
                                 "(dither adds random noise to each clip); set it to 0")
        self.preemphasis = number(fields["preemphasis"], "preemphasis", where)
        self.htk_preemphasis = flag(fields, "preemphasis_htk_flavor", where)
        self.scale = number(fields["input_scale_factor"], "input_scale_factor", where)
        self.mel_floor = number(fields["mel_floor"], "mel_floor", where)
        self.fft_length = 2 ** math.ceil(math.log2(self.frame_length)) * (2 if flag(fields, "fft_overdrive", where)
                                                                          else 1)
        low, high = number(fields["min_frequency"], "min_frequency", where), number(fields["max_frequency"],
                                                                                     "max_frequency", where)
        if not 0 <= low <= high:
            raise ModelLoadError(f"{where}: min_frequency {low} and max_frequency {high} must rise from 0")
        # periodic Hann window (transformers' window_function), float32 as its extractor keeps it
        self.window = np.hanning(self.frame_length + 1)[:-1].astype(np.float32)
        self.mel_filters = htk_mel_filters(self.fft_length // 2 + 1, self.feature_size, low, high,
                                           self.sampling_rate)
        self.per_bin_mean = self._per_bin(fields["per_bin_mean"], "per_bin_mean")
        self.per_bin_stddev = self._per_bin(fields["per_bin_stddev"], "per_bin_stddev")
        self.audio_seq_length = positive_int(audio_seq_length, "audio_seq_length", where)
        self.audio_ms_per_token = positive_int(audio_ms_per_token, "audio_ms_per_token", where)

    def _per_bin(self, value: Any, name: str) -> np.ndarray | None:
        if value is None:
            return None
        if not isinstance(value, (list, tuple)) or len(value) != self.feature_size:
            raise ModelLoadError(f"{self.where}: {name} must be {self.feature_size} numbers (one per mel bin)")
        return np.array([number(v, name, self.where) for v in value])

    @classmethod
    def from_model_dir(cls, path: str | os.PathLike[str]) -> Gemma4AudioFeatureExtractor | None:
        """transformers' files in its order (module docstring); None when the folder has no extractor config."""
        processor = read_json_object(os.path.join(path, PROCESSOR_FILE))
        limits = {k: processor.get(k, v) for k, v in _PROCESSOR_DEFAULTS.items()}
        nested = processor.get("feature_extractor", processor.get("audio_processor"))
        if isinstance(nested, Mapping):
            return cls(nested, f"{PROCESSOR_FILE}: feature_extractor", **limits)
        legacy = read_json_object(os.path.join(path, PREPROCESSOR_FILE))
        if str(legacy.get("feature_extractor_type", "")).startswith("Gemma4AudioFeatureExtractor"):
            return cls(legacy, PREPROCESSOR_FILE, **limits)
        return None

    @property
    def max_samples(self) -> int:
        """The longest clip: audio_seq_length tokens of audio_ms_per_token each (30 s at Gemma 4's defaults)."""
        return self.audio_seq_length * self.audio_ms_per_token * self.sampling_rate // 1000

    def frames(self, samples: int) -> int:
        """Log-mel frames whose whole window is real audio."""
        return max((samples + self.frame_length // 2 - (self.frame_length + 1)) // self.hop_length + 1, 0)

    def tokens(self, frames: int) -> int:
        """Soft tokens of `frames` log-mel frames: the tower's two stride-2 convolutions (Gemma4Processor's
        count, which vLLM's matches)."""
        for _ in range(2):
            frames = (frames - 1) // 2 + 1 if frames > 0 else 0
        return frames

    def check(self, samples: int) -> None:
        """ValueError naming the problem: an empty clip, one too short for a token, one longer than max_samples."""
        rate = self.sampling_rate
        if samples == 0:
            raise ValueError("empty audio (no samples)")
        if samples > self.max_samples:
            raise ValueError(f"a {samples / rate:.2f} s clip is longer than the {self.max_samples / rate:g} s Gemma 4 "
                             f"takes in one clip (audio_seq_length {self.audio_seq_length} x audio_ms_per_token "
                             f"{self.audio_ms_per_token} ms); split it into shorter clips")
        if self.tokens(self.frames(samples)) == 0:
            raise ValueError(f"a {samples}-sample clip is too short for one log-mel frame (at least "
                             f"{self.frame_length + 1 - self.frame_length // 2} samples)")

    def features(self, audio: Any) -> np.ndarray:
        """float32 [frames, feature_size] of a clip (an Audio, or mono samples at sampling_rate). ValueError: see
        check."""
        samples = np.asarray(getattr(audio, "samples", audio), dtype=np.float32)
        self.check(len(samples))
        wave = samples * self.scale if self.scale != 1.0 else samples
        wave = np.pad(wave, (self.frame_length // 2, 0))
        size = self.frame_length + 1
        count = self.frames(len(samples))
        frames = np.lib.stride_tricks.as_strided(wave, shape=(count, size),
                                                 strides=(wave.strides[0] * self.hop_length, wave.strides[0]))
        if self.preemphasis > 0.0:
            if self.htk_preemphasis:
                frames = np.concatenate([frames[:, :1] * (1.0 - self.preemphasis),
                                         frames[:, 1:-1] - self.preemphasis * frames[:, :-2]], axis=-1)
            else:
                frames = frames[:, 1:] - self.preemphasis * frames[:, :-1]
        else:
            frames = frames[:, :-1]
        spectrum = np.abs(np.fft.rfft(frames * self.window, n=self.fft_length, axis=-1))
        log_mel = np.log(np.matmul(spectrum, self.mel_filters) + self.mel_floor)
        if self.per_bin_mean is not None:
            log_mel = log_mel - self.per_bin_mean
        if self.per_bin_stddev is not None:
            log_mel = log_mel / self.per_bin_stddev
        return np.ascontiguousarray(log_mel, dtype=np.float32)


# (start, length) of a placeholder in the prompt, the tokens it becomes, and its items (offsets from its start)
Piece = tuple[int, int, list[int], list[MultiModalItem]]


def audio_pieces(prompts: Any, ids: list[int], clips: Sequence[Any], what: str, param: str) -> list[Piece]:
    """Each clip's tokens at its placeholder: a single `<|audio|>` becomes begin-of-audio, the clip's soft tokens
    and end-of-audio; a run already of the clip's count between begin and end of audio stays (module docstring).
    `prompts`: the family's rules (audio_processor, audio_token_id, boa_token_id, eoa_token_id, audio_limit)."""
    from ferrox.multimodal.processing import token_runs

    processed = prompts.processed_clips(clips, what, param,
                                        lambda clip, features: prompts.audio_processor.tokens(features.shape[0]))
    boa, eoa, token = prompts.boa_token_id, prompts.eoa_token_id, prompts.audio_token_id
    spans: list[tuple[int, int, bool]] = []
    for start, length in token_runs(ids, token):
        k = len(spans)
        wrapped = 0 < start and start + length < len(ids) and ids[start - 1] == boa and ids[start + length] == eoa
        if wrapped and k < len(processed) and processed[k][1] == length:
            spans.append((start, length, True))
        else:  # placeholders side by side: one clip each
            spans.extend((start + i, 1, False) for i in range(length))
    if len(spans) != len(clips):
        placeholder = prompts.audio_placeholder or "<|audio|>"
        raise InvalidArgumentError(f"{what}: the prompt has {len(spans)} audio placeholder(s) ({placeholder!r}) for "
                                   f"{len(clips)} audio clip(s); put one placeholder where each clip goes (its tokens "
                                   "are expanded here)", param=param)
    pieces: list[Piece] = []
    for (start, length, expanded), (features, count, digest) in zip(spans, processed, strict=True):
        item = MultiModalItem.from_pixels(0 if expanded else 1, count, features, digest, modality=AUDIO_MODALITY)
        tokens = [token] * count
        pieces.append((start, length, tokens if expanded else [boa, *tokens, eoa], [item]))
    return pieces


def add_audio(prompts: Any, model_dir: str, hf_config: Mapping[str, Any], tokenizer: Any,
              limit: int | None) -> None:
    """The folder's audio rules on Gemma 4's prompt rules, or why its audio is refused (audio_refusal)."""
    prompts.audio_token_id = token = int(hf_config.get("audio_token_id") or DEFAULT_AUDIO_TOKEN_ID)
    prompts.boa_token_id = int(hf_config.get("boa_token_id") or DEFAULT_BOA_TOKEN_ID)
    prompts.eoa_token_id = int(hf_config.get("eoa_token_id") or hf_config.get("eoa_token_index")
                               or DEFAULT_EOA_TOKEN_ID)
    refused = "Gemma 4 takes no audio inputs from this folder: "
    if hf_config.get("audio_config") is None:
        prompts.audio_refusal = refused + f"config.json has no audio_config (audio inputs: {AUDIO_FAMILIES})"
        return
    placeholder = tokenizer.id_to_token(token)
    if placeholder is None:
        prompts.audio_refusal = refused + f"config.json's audio_token_id {token} is not in the tokenizer's vocabulary"
        return
    try:
        extractor = Gemma4AudioFeatureExtractor.from_model_dir(model_dir) if os.path.isdir(model_dir) else None
    except (ModelLoadError, UnsupportedModelError) as e:
        prompts.audio_refusal = refused + str(e)
        return
    if extractor is None:
        prompts.audio_refusal = refused + (f"model folder {model_dir} has no feature extractor config "
                                           f"({PROCESSOR_FILE}'s feature_extractor)")
        return
    bins = 4 * (int((hf_config["audio_config"].get("subsampling_conv_channels") or [128])[0]) // 4)
    if extractor.feature_size != bins:
        prompts.audio_refusal = refused + (f"{extractor.where}: feature_size {extractor.feature_size} differs from "
                                           f"the {bins} mel bins the audio tower takes (config.json's audio_config)")
        return
    prompts.audio_processor, prompts.audio_placeholder, prompts.audio_limit = extractor, placeholder, limit
