"""Voxtral (VoxtralForConditionalGeneration): a clip's log-mel windows, its audio-token count, and what its
`[BEGIN_AUDIO][AUDIO]` becomes. Voxtral's audio goes through --tokenizer-mode mistral only, as in vLLM (which
refuses the model under any other mode): tekken.json's `audio` settings (mistral_common's AudioConfig) say how a
clip is cut and counted, and its [AUDIO] / [BEGIN_AUDIO] ids are the ones mistral_common writes.

- Features: mistral_common pads a clip with zeros to a whole number of chunk_length_s windows (30 s: 480,000
  samples at 16 kHz); Whisper's log-mel is taken over the whole padded clip (qwen2_audio_processing.py's
  WhisperFeatureExtractor: window_size-sample frames every hop_length, num_mel_bins Slaney filters, log10 floored,
  raised to 8 below the maximum of the whole clip, (x + 4) / 4), then cut into windows of
  2 x max_source_positions frames (3,000), each of which the encoder reads whole. This is transformers'
  VoxtralProcessor (WhisperFeatureExtractor with pad_to_multiple_of 480,000, then split by max_source_positions)
  and vLLM's (the maximum taken over every window of a clip). A clip longer than 30 s is several windows: nothing
  is dropped or split into requests.
- Count: mistral_common's, ceil(frames / (sampling_rate / frame_rate / hop_length)) over the padded clip: 375
  tokens a 30 s window on the release, one per four encoder positions (the projector's grouping of
  intermediate_size / hidden_size rows). A tekken.json whose count differs from the encoder's refuses audio by
  name.
- Prompts: a chat is encoded by mistral_common (loader/mistral_tokenizer.py) with PlaceholderAudioEncoder, which
  writes `[BEGIN_AUDIO][AUDIO]` per audio chunk and reads no audio; these rules then put the clip's run of [AUDIO]
  in place of its lone [AUDIO] (a run already of the clip's count stays as it is): the ids of mistral_common's
  encode_chat_completion with the audio itself (its AudioEncoder writes [BEGIN_AUDIO] and the count of [AUDIO]).
  A text prompt's "[AUDIO]" stays text in this mode: offline callers send prompt_token_ids (or a chat).
- Images and videos are refused by name. Streaming (Voxtral Realtime's) audio settings, a tekken.json without
  chunk_length_s, and a folder outside tokenizer_mode mistral leave audio refused, naming why.

Front-end code: numpy and mistral_common.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from ferrox.errors import InvalidArgumentError, ModelLoadError, UnsupportedModelError
from ferrox.multimodal.inputs import MultiModalItem
from ferrox.multimodal.media_prompts import MediaPrompts
from ferrox.multimodal.qwen2_audio_processing import WhisperFeatureExtractor, whisper_scale

ARCHITECTURE = "VoxtralForConditionalGeneration"
AUDIO_MODALITY = "audio"
DEFAULT_AUDIO_TOKEN_ID = 24  # VoxtralProcessor's audio_token_id: [AUDIO]
AUDIO_TOKEN, BEGIN_AUDIO_TOKEN, TRANSCRIBE_TOKEN = "[AUDIO]", "[BEGIN_AUDIO]", "[TRANSCRIBE]"
TEKKEN_FILE = "tekken.json"
# The speech-to-text server cuts a recording longer than its model's `max_samples` into clips (multimodal/
# audio_chunks.py); vLLM hands Voxtral a recording whole (its windows are the encoder's business), so this is
# never reached: a recording whose tokens do not fit the model's length is refused by the length check.
WHOLE_RECORDING = 2**62
# What an {"type": "audio"} chat part becomes for mistral_common's ChatCompletionRequest.from_openai: an audio
# chunk (non-empty, which it checks) that PlaceholderAudioEncoder encodes without reading.
PLACEHOLDER_AUDIO_DATA = "AA=="
PLACEHOLDER_AUDIO_PART = {"type": "input_audio", "input_audio": {"data": PLACEHOLDER_AUDIO_DATA, "format": "wav"}}


class _Encoding(NamedTuple):  # (what mistral_common reads of an AudioEncoding)
    tokens: list[int]
    audio: Any


@dataclass(frozen=True, slots=True)
class PlaceholderAudioEncoder:
    """mistral_common's audio encoder for a chat's (or a transcription request's) encoding: `[BEGIN_AUDIO][AUDIO]`
    per audio chunk; the real encoder's settings and ids, which mistral_common also reads."""

    audio_config: Any
    special_ids: Any

    def __call__(self, chunk: Any) -> _Encoding:
        return _Encoding([int(self.special_ids.begin_audio), int(self.special_ids.audio)], None)


def placeholder_instruct(instruct: Any) -> Any:
    """A copy of mistral_common's instruct tokenizer whose audio chunks encode through PlaceholderAudioEncoder
    (everything else shared); the instruct tokenizer itself when it has no audio encoder."""
    import copy

    encoder = getattr(instruct, "audio_encoder", None)
    if encoder is None:
        return instruct
    out = copy.copy(instruct)
    out.audio_encoder = PlaceholderAudioEncoder(encoder.audio_config, encoder.special_ids)
    return out


class VoxtralFeatureExtractor(WhisperFeatureExtractor):
    """`features(audio)` -> float32 [windows x window_frames, feature_size] of one clip; `tokens(samples)` its audio
    tokens (module docstring). Built from mistral_common's AudioConfig (tekken.json's `audio`)."""

    def __init__(self, config: Mapping[str, Any], where: str, tokens_per_window: int):
        super().__init__(config, where)
        self.window_samples = self.max_samples
        self.tokens_per_window = tokens_per_window
        self.max_samples = WHOLE_RECORDING

    def windows(self, samples: int) -> int:
        return -(-samples // self.window_samples)

    def tokens(self, samples: int) -> int:
        return self.windows(samples) * self.tokens_per_window

    def check(self, samples: int) -> None:
        if samples == 0:
            raise ValueError("empty audio (no samples)")

    def features(self, audio: Any) -> np.ndarray:
        samples = np.asarray(getattr(audio, "samples", audio), dtype=np.float32)
        self.check(len(samples))
        wave = np.full(self.windows(len(samples)) * self.window_samples, self.padding_value, dtype=np.float64)
        wave[:len(samples)] = samples
        return np.ascontiguousarray(whisper_scale(self.log_mel(wave)), dtype=np.float32)


def extractor_of(audio_config: Any, encoder_config: Mapping[str, Any]) -> VoxtralFeatureExtractor:
    """The extractor of mistral_common's AudioConfig for an encoder of `encoder_config` (config.json's
    audio_config); UnsupportedModelError naming the setting where the two disagree."""
    where = f"{TEKKEN_FILE} audio"
    if getattr(audio_config, "is_streaming", False):
        raise UnsupportedModelError(f"{where}: transcription_format 'streaming' (Voxtral Realtime's) is not supported")
    chunk = audio_config.chunk_length_s
    if chunk is None or not float(chunk).is_integer():
        raise UnsupportedModelError(f"{where}: chunk_length_s {chunk!r}: Voxtral's encoder reads whole windows of a "
                                    "whole number of seconds (30)")
    spectrogram = audio_config.encoding_config
    rate, hop = int(audio_config.sampling_rate), int(spectrogram.hop_length)
    extractor_config = {"feature_size": int(spectrogram.num_mel_bins), "sampling_rate": rate, "hop_length": hop,
                        "n_fft": int(spectrogram.window_size), "chunk_length": int(chunk)}
    bins = int(encoder_config.get("num_mel_bins", 128))
    if extractor_config["feature_size"] != bins:
        raise UnsupportedModelError(f"{where}: num_mel_bins {extractor_config['feature_size']} differs from the "
                                    f"audio encoder's {bins} (config.json's audio_config)")
    positions = int(encoder_config.get("max_source_positions", 1500))
    window_frames = int(chunk) * rate // hop
    if window_frames != 2 * positions:
        raise UnsupportedModelError(f"{where}: a {int(chunk)} s window is {window_frames} log-mel frames; the audio "
                                    f"encoder reads {2 * positions} (2 x max_source_positions {positions})")
    group = encoder_group(encoder_config)
    frames_per_token = int(rate // audio_config.frame_rate) // hop  # (mistral_common's audio_length_per_tok)
    counted = math.ceil(window_frames / frames_per_token) if frames_per_token > 0 else 0
    if counted != positions // group or positions % group:
        raise UnsupportedModelError(f"{where}: frame_rate {audio_config.frame_rate} gives {counted} audio tokens a "
                                    f"window; the encoder gives {positions} positions / {group} = "
                                    f"{positions / group:g}")
    try:
        return VoxtralFeatureExtractor(extractor_config, where, positions // group)
    except ModelLoadError as e:
        raise UnsupportedModelError(str(e)) from None


def encoder_group(encoder_config: Mapping[str, Any]) -> int:
    """Encoder rows per audio token: the projector reads intermediate_size values a row, hidden_size at a time
    (transformers' reshape; 5120 / 1280 = 4 on the release)."""
    width = int(encoder_config.get("hidden_size", encoder_config.get("d_model", 1280)))
    inner = int(encoder_config.get("intermediate_size", encoder_config.get("encoder_ffn_dim", 5120)))
    if width < 1 or inner % width:
        raise UnsupportedModelError(f"config.json: audio_config.intermediate_size {inner} is not a multiple of its "
                                    f"hidden_size {width} (the projector reads whole groups of encoder rows)",
                                    param="audio_config.intermediate_size")
    return inner // width


@dataclass(slots=True)
class VoxtralPrompts(MediaPrompts):
    """Voxtral's prompt rules: audio clips only (MediaPrompts' audio fields; images and videos refused)."""

    def check_count(self, count: int, what: str, param: str = "multi_modal_data") -> None:
        if count:
            raise InvalidArgumentError(f"{what}: {count} image(s): Voxtral takes no images (audio inputs only)",
                                       param=param)

    def expand(self, prompt_ids: Sequence[int], images: Sequence[Any], what: str,
               param: str = "multi_modal_data") -> tuple[list[int], list[MultiModalItem]]:
        """`images`: the prompt's decoded media in order; only multimodal.audio.Audio clips are taken. Each run of
        [AUDIO] is one clip's: a lone one (mistral_common's chat with PlaceholderAudioEncoder) or one already of
        the clip's count."""
        from ferrox.multimodal.audio import is_audio
        from ferrox.multimodal.processing import token_runs

        others = [m for m in images if not is_audio(m)]
        if others:
            self.check_count(len(others), what, param)
        ids = list(prompt_ids)
        token = self.audio_token_id
        runs = token_runs(ids, token)
        if not images and not runs:
            return ids, []
        processed = self.processed_clips(images, what, param,
                                         lambda clip, features: self.audio_processor.tokens(len(clip.samples)))
        if len(runs) != len(images):
            raise InvalidArgumentError(
                f"{what}: the prompt has {len(runs)} audio placeholder(s) ([BEGIN_AUDIO][AUDIO]) for {len(images)} "
                "audio clip(s); send a chat (mistral_common writes one per audio part) or prompt_token_ids with "
                "[BEGIN_AUDIO][AUDIO] where each clip goes", param=param)
        out: list[int] = []
        items: list[MultiModalItem] = []
        at = 0
        for k, ((start, length), (features, count, digest)) in enumerate(zip(runs, processed, strict=True)):
            if start == 0 or ids[start - 1] != self.boa_token_id:
                raise InvalidArgumentError(f"{what}: audio {k}: its [AUDIO] does not follow [BEGIN_AUDIO] (id "
                                           f"{self.boa_token_id}), as mistral_common writes a clip", param=param)
            if length not in (1, count):
                raise InvalidArgumentError(f"{what}: audio {k}: a run of {length} [AUDIO] tokens; the clip gives "
                                           f"{count} (one [AUDIO] is expanded here)", param=param)
            out.extend(ids[at:start])
            items.append(MultiModalItem.from_pixels(len(out), count, features, digest, modality=AUDIO_MODALITY))
            out.extend([token] * count)
            at = start + length
        out.extend(ids[at:])
        return out, items


def voxtral_prompts(model_dir: str, hf_config: Mapping[str, Any], tokenizer: Any, *,
                    audio_limit: int | None, allowed_local_media_path: str | None) -> VoxtralPrompts:
    """The prompt rules of a Voxtral folder (hf_config: config.json). Its audio is refused, naming why, outside
    tokenizer_mode mistral, for a tekken.json without audio settings, or for settings the encoder cannot read."""
    token = int(hf_config.get("audio_token_id", hf_config.get("audio_token_index", DEFAULT_AUDIO_TOKEN_ID)))
    prompts = VoxtralPrompts(-1, 0, AUDIO_TOKEN, None, model_dir, 0, allowed_local_media_path,
                             video_refusal="Voxtral takes no video inputs (audio inputs only)")
    prompts.audio_token_id = token
    prompts.audio_limit = audio_limit
    refused = "Voxtral takes no audio inputs from this folder: "
    mistral = getattr(tokenizer, "mistral", None)
    if mistral is None:
        prompts.audio_refusal = refused + ("its audio is encoded by mistral_common from tekken.json: serve it with "
                                           "--tokenizer-mode mistral (vLLM requires it too)")
        return prompts
    encoder = getattr(mistral.instruct_tokenizer, "audio_encoder", None)
    if encoder is None:
        prompts.audio_refusal = refused + f"{TEKKEN_FILE} has no `audio` settings (or its version is before v7)"
        return prompts
    ids = encoder.special_ids
    if ids.audio is None or ids.begin_audio is None:
        prompts.audio_refusal = refused + f"{TEKKEN_FILE} has no [AUDIO] or [BEGIN_AUDIO] token"
        return prompts
    if int(ids.audio) != token:
        prompts.audio_refusal = refused + (f"{TEKKEN_FILE}'s [AUDIO] is id {ids.audio}, config.json's audio_token_id "
                                           f"is {token}")
        return prompts
    try:
        prompts.audio_processor = extractor_of(encoder.audio_config, hf_config.get("audio_config") or {})
    except UnsupportedModelError as e:
        prompts.audio_refusal = refused + str(e)
        return prompts
    prompts.boa_token_id = int(ids.begin_audio)
    prompts.audio_placeholder = BEGIN_AUDIO_TOKEN + AUDIO_TOKEN
    return prompts
