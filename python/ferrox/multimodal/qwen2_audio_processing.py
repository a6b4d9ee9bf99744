"""Qwen2-Audio: a clip's Whisper log-mel features, its audio-token count, and what its `<|AUDIO|>` becomes.

transformers' WhisperFeatureExtractor as Qwen2AudioProcessor calls it (padding "max_length", an attention mask):
the clip padded with padding_value to chunk_length (30 s: n_samples = 480,000 at 16 kHz), n_fft (400) sample
windows every hop_length (160) samples, reflect-padded by n_fft // 2 at both ends (torch.stft's centring), a
periodic Hann window, the power spectrum, Slaney-normalized mel filters on the Slaney scale (feature_size: 128 bins
for Qwen2-Audio, 0..8 kHz), log10 floored at 1e-10, the last frame dropped (3,000 frames), then everything raised
to at most 8 below the clip's maximum and mapped by (x + 4) / 4. The maximum is over the whole padded window, so
the whole window is computed even for a short clip. Computed in float64: equal to the extractor's numpy path to a
float32 ulp, and within 1e-4 of its default torch path (a float32 STFT) on noisy clips.

The count is the processor's: the mask covers ceil(samples / hop) frames (L); the encoder's stride-2 convolution
leaves (L - 1) // 2 + 1 positions that attend to each other (the rest masked), and its average pool of two gives
((L - 1) // 2 + 1 - 2) // 2 + 1 audio tokens (vLLM counts the same way). Only the frames those positions read are
kept for the tower: 2 x positions + 1 (the convolutions' reach; at most the window's 3,000), so a short clip does
not carry 30 s of padding to the engine, and the tower's rows equal transformers' over the padded window.

A clip longer than the window is refused by name: transformers' extractor truncates it to 30 s, and vLLM, which
runs that processor, answers about the first 30 s without a word; split it into clips instead. A clip too short
for one token (320 samples or fewer) is refused too. dither (random noise) and do_normalize are refused by name:
the features are deterministic (a repeated clip keeps its prefix-cache blocks) and the checkpoints leave
normalization off.

Prompt expansion is Qwen2AudioProcessor's: each `<|AUDIO|>` becomes the clip's run of `<|AUDIO|>` tokens (the
chat template writes `<|audio_bos|>` and `<|audio_eos|>` around it); a run between them already of the clip's
count (ids from the processor) stays as it is. Images and videos are refused by name. numpy only (the front-end).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ferrox.errors import InvalidArgumentError, ModelLoadError, UnsupportedModelError
from ferrox.multimodal.config_fields import PREPROCESSOR_FILE, number, positive_int, read_json_object
from ferrox.multimodal.inputs import MultiModalItem
from ferrox.multimodal.media_prompts import MediaPrompts

ARCHITECTURE = "Qwen2AudioForConditionalGeneration"
AUDIO_MODALITY = "audio"
DEFAULT_AUDIO_TOKEN_ID = 151_646  # Qwen2AudioConfig's audio_token_index: `<|AUDIO|>`
AUDIO_TOKEN, BOS_TOKEN, EOS_TOKEN = "<|AUDIO|>", "<|audio_bos|>", "<|audio_eos|>"
# WhisperFeatureExtractor's defaults (Qwen2-Audio's preprocessor_config.json sets feature_size 128).
_DEFAULTS: dict[str, Any] = {"feature_size": 80, "sampling_rate": 16_000, "hop_length": 160, "chunk_length": 30,
                             "n_fft": 400, "padding_value": 0.0, "dither": 0.0, "do_normalize": False}


def _slaney_mel(hz: np.ndarray) -> np.ndarray:
    """Hz -> mel on the Slaney scale: linear below 1 kHz, logarithmic above."""
    mel = 3.0 * hz / 200.0
    log_part = hz >= 1000.0
    mel[log_part] = 15.0 + np.log(hz[log_part] / 1000.0) * (27.0 / np.log(6.4))
    return mel


def _slaney_hz(mel: np.ndarray) -> np.ndarray:
    hz = 200.0 * mel / 3.0
    log_part = mel >= 15.0
    hz[log_part] = 1000.0 * np.exp(np.log(6.4) / 27.0 * (mel[log_part] - 15.0))
    return hz


def slaney_mel_filters(bins: int, filters: int, low: float, high: float, rate: int) -> np.ndarray:
    """[bins, filters] float64 triangles over the FFT bins, their corners evenly spaced on the Slaney mel scale,
    each scaled to unit area (transformers' mel_filter_bank with norm and mel_scale "slaney")."""
    mels = np.linspace(_slaney_mel(np.array([low]))[0], _slaney_mel(np.array([high]))[0], filters + 2)
    corners = _slaney_hz(mels)
    freqs = np.linspace(0, rate // 2, bins)
    widths = np.diff(corners)
    slopes = corners[None, :] - freqs[:, None]
    down = -slopes[:, :-2] / widths[:-1]
    up = slopes[:, 2:] / widths[1:]
    bank = np.maximum(0.0, np.minimum(down, up))
    return bank * (2.0 / (corners[2:filters + 2] - corners[:filters]))


def whisper_scale(log_mel: np.ndarray) -> np.ndarray:
    """Whisper's normalization of a clip's log-mel: raised to at most 8 below its maximum (over every frame of the
    clip, padding included), then (x + 4) / 4."""
    return (np.maximum(log_mel, log_mel.max() - 8.0) + 4.0) / 4.0


class WhisperFeatureExtractor:
    """`features(audio)` -> float32 [frames kept, feature_size] of one clip (module docstring); `tokens(samples)`
    its audio tokens."""

    def __init__(self, config: Mapping[str, Any], where: str = PREPROCESSOR_FILE):
        kind = config.get("feature_extractor_type")
        if kind is not None and str(kind) != "WhisperFeatureExtractor":
            raise UnsupportedModelError(f"{where}: feature_extractor_type {kind!r} is not Qwen2-Audio's "
                                        "(WhisperFeatureExtractor)")
        fields = {**_DEFAULTS, **{k: v for k, v in config.items() if k in _DEFAULTS and v is not None}}
        self.where = where
        self.feature_size = positive_int(fields["feature_size"], "feature_size", where)
        self.sampling_rate = positive_int(fields["sampling_rate"], "sampling_rate", where)
        self.hop_length = positive_int(fields["hop_length"], "hop_length", where)
        self.n_fft = positive_int(fields["n_fft"], "n_fft", where)
        self.chunk_length = positive_int(fields["chunk_length"], "chunk_length", where)
        self.padding_value = number(fields["padding_value"], "padding_value", where)
        if number(fields["dither"], "dither", where) != 0.0:
            raise ModelLoadError(f"{where}: dither {fields['dither']!r}: ferrox computes deterministic features "
                                 "(dither adds random noise to each clip); set it to 0")
        if fields["do_normalize"]:
            raise ModelLoadError(f"{where}: do_normalize {fields['do_normalize']!r} is not supported (Qwen2-Audio's "
                                 "extractor leaves the waveform unnormalized)")
        self.max_samples = self.chunk_length * self.sampling_rate  # n_samples
        self.window_frames = self.max_samples // self.hop_length  # nb_max_frames (3,000)
        if self.n_fft // 2 >= self.max_samples:
            raise ModelLoadError(f"{where}: n_fft {self.n_fft} is too long for a {self.chunk_length} s window")
        self.window = np.hanning(self.n_fft + 1)[:-1]  # periodic Hann
        self.mel_filters = slaney_mel_filters(self.n_fft // 2 + 1, self.feature_size, 0.0, 8000.0,
                                              self.sampling_rate)

    @classmethod
    def from_model_dir(cls, path: str | os.PathLike[str]) -> WhisperFeatureExtractor | None:
        """preprocessor_config.json's extractor; None when the folder has none."""
        config = read_json_object(os.path.join(path, PREPROCESSOR_FILE))
        return cls(config) if config else None

    def mask_frames(self, samples: int) -> int:
        """Frames the processor's attention mask covers (L)."""
        return min(self.window_frames, math.ceil(samples / self.hop_length))

    def tokens(self, samples: int) -> int:
        """Audio tokens of a clip of `samples` samples (Qwen2AudioProcessor's count)."""
        positions = (self.mask_frames(samples) - 1) // 2 + 1
        return (positions - 2) // 2 + 1

    def kept_frames(self, samples: int) -> int:
        """The frames the tower reads for the clip's positions: 2 x positions + 1, at most the window."""
        positions = (self.mask_frames(samples) - 1) // 2 + 1
        return min(self.window_frames, 2 * positions + 1)

    def check(self, samples: int) -> None:
        """ValueError naming the problem: an empty clip, one too short for a token, one longer than the window."""
        rate = self.sampling_rate
        if samples == 0:
            raise ValueError("empty audio (no samples)")
        if samples > self.max_samples:
            raise ValueError(f"a {samples / rate:.2f} s clip is longer than the {self.chunk_length} s Qwen2-Audio takes "
                             "in one clip (the feature extractor's chunk_length); split it into shorter clips")
        if self.tokens(samples) < 1:
            raise ValueError(f"a {samples}-sample clip is too short for one audio token (at least "
                             f"{2 * self.hop_length + 1} samples)")

    def features(self, audio: Any) -> np.ndarray:
        """float32 [kept_frames, feature_size] of a clip (an Audio, or mono samples at sampling_rate). ValueError:
        see check."""
        samples = np.asarray(getattr(audio, "samples", audio), dtype=np.float32)
        self.check(len(samples))
        wave = np.full(self.max_samples, self.padding_value, dtype=np.float64)
        wave[:len(samples)] = samples
        log_mel = whisper_scale(self.log_mel(wave))
        return np.ascontiguousarray(log_mel[:self.kept_frames(len(samples))], dtype=np.float32)

    def log_mel(self, wave: np.ndarray) -> np.ndarray:
        """float64 [len(wave) // hop_length, feature_size]: the floored log10 mel power of a padded float64
        waveform (n_fft-sample frames every hop_length, reflect-padded by n_fft // 2, the last frame dropped),
        before whisper_scale. Computed a window of frames at a time, so a clip of several windows (Voxtral's)
        holds one window's spectrum at once."""
        half = self.n_fft // 2
        padded = np.pad(wave, (half, half), mode="reflect")
        count = len(wave) // self.hop_length
        frames = np.lib.stride_tricks.as_strided(padded, shape=(count, self.n_fft),
                                                 strides=(padded.strides[0] * self.hop_length, padded.strides[0]))
        out = np.empty((count, self.feature_size), dtype=np.float64)
        for at in range(0, count, self.window_frames):
            power = np.abs(np.fft.rfft(frames[at:at + self.window_frames] * self.window, axis=-1)) ** 2
            out[at:at + self.window_frames] = np.log10(np.maximum(power @ self.mel_filters, 1e-10))
        return out


@dataclass(slots=True)
class Qwen2AudioPrompts(MediaPrompts):
    """Qwen2-Audio's prompt rules: audio clips only (MediaPrompts' audio fields; images and videos refused)."""

    def check_count(self, count: int, what: str, param: str = "multi_modal_data") -> None:
        if count:
            raise InvalidArgumentError(f"{what}: {count} image(s): Qwen2-Audio takes no images (audio inputs only)",
                                       param=param)

    def expand(self, prompt_ids: Sequence[int], images: Sequence[Any], what: str,
               param: str = "multi_modal_data") -> tuple[list[int], list[MultiModalItem]]:
        """`images`: the prompt's decoded media in order; only multimodal.audio.Audio clips are taken."""
        from ferrox.multimodal.audio import is_audio
        from ferrox.multimodal.processing import token_runs

        others = [m for m in images if not is_audio(m)]
        if others:
            self.check_count(len(others), what, param)
        ids = list(prompt_ids)
        token = self.audio_token_id
        if not images and token not in ids:
            return ids, []
        processed = self.processed_clips(images, what, param,
                                         lambda clip, features: self.audio_processor.tokens(len(clip.samples)))
        # (start, length, already expanded) of each clip's placeholder
        spans: list[tuple[int, int, bool]] = []
        for start, length in token_runs(ids, token):
            k = len(spans)
            wrapped = (0 < start and start + length < len(ids) and ids[start - 1] == self.boa_token_id
                       and ids[start + length] == self.eoa_token_id)
            if wrapped and length > 1 and k < len(processed) and processed[k][1] == length:
                spans.append((start, length, True))
            else:  # (the processor replaces every `<|AUDIO|>`: tokens side by side are one clip each)
                spans.extend((start + i, 1, False) for i in range(length))
        if len(spans) != len(images):
            raise InvalidArgumentError(
                f"{what}: the prompt has {len(spans)} audio placeholder(s) ({self.audio_placeholder!r}) for "
                f"{len(images)} audio clip(s); put one placeholder where each clip goes (its tokens are expanded "
                "here)", param=param)
        out: list[int] = []
        items: list[MultiModalItem] = []
        at = 0
        for (start, length, _), (features, count, digest) in zip(spans, processed, strict=True):
            out.extend(ids[at:start])
            items.append(MultiModalItem.from_pixels(len(out), count, features, digest, modality=AUDIO_MODALITY))
            out.extend([token] * count)
            at = start + length
        out.extend(ids[at:])
        return out, items


def qwen2_audio_prompts(model_dir: str, hf_config: Mapping[str, Any], tokenizer: Any, *,
                        audio_limit: int | None, allowed_local_media_path: str | None) -> Qwen2AudioPrompts:
    """The prompt rules of a Qwen2-Audio folder (hf_config: config.json). Its audio is refused, naming why, for a
    folder without the extractor config or a tokenizer without `<|AUDIO|>`."""
    token = int(hf_config.get("audio_token_index", hf_config.get("audio_token_id", DEFAULT_AUDIO_TOKEN_ID)))
    prompts = Qwen2AudioPrompts(-1, 0, AUDIO_TOKEN, None, model_dir, 0, allowed_local_media_path,
                                video_refusal="Qwen2-Audio takes no video inputs (audio inputs only)")
    prompts.audio_token_id = token
    prompts.audio_limit = audio_limit
    bos, eos = tokenizer.token_to_id(BOS_TOKEN), tokenizer.token_to_id(EOS_TOKEN)
    prompts.boa_token_id = -1 if bos is None else int(bos)
    prompts.eoa_token_id = -1 if eos is None else int(eos)
    refused = "Qwen2-Audio takes no audio inputs from this folder: "
    placeholder = tokenizer.id_to_token(token)
    if placeholder is None:
        prompts.audio_refusal = refused + f"config.json's audio_token_index {token} is not in the tokenizer's vocabulary"
        return prompts
    try:
        extractor = WhisperFeatureExtractor.from_model_dir(model_dir) if os.path.isdir(model_dir) else None
    except (ModelLoadError, UnsupportedModelError) as e:
        prompts.audio_refusal = refused + str(e)
        return prompts
    if extractor is None:
        prompts.audio_refusal = refused + f"model folder {model_dir} has no {PREPROCESSOR_FILE}"
        return prompts
    bins = int((hf_config.get("audio_config") or {}).get("num_mel_bins", 128))
    if extractor.feature_size != bins:
        prompts.audio_refusal = refused + (f"{PREPROCESSOR_FILE}: feature_size {extractor.feature_size} differs from "
                                           f"the audio encoder's num_mel_bins {bins} (config.json's audio_config)")
        return prompts
    prompts.audio_processor = extractor
    prompts.audio_placeholder = (f"{BOS_TOKEN}{placeholder}{EOS_TOKEN}" if bos is not None and eos is not None
                                 else placeholder)
    return prompts
