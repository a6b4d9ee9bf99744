"""A tiny random Voxtral checkpoint (transformers' VoxtralForConditionalGeneration) for tests/models/test_voxtral.py,
in the Hugging Face layout of mistralai/Voxtral-Mini-3B-2507: config.json + model.safetensors, a tekken.json (no
tokenizer.json, as on the hub) and WhisperFeatureExtractor's preprocessor_config.json.

- the encoder: two layers, 32 wide over 128 mel bins, the released max_source_positions 1500 (a 30 s window);
  intermediate_size 128 = 4 x 32, so the projector reads the encoder's rows four at a time, as the release does;
- the language model: a two-layer Llama over the tekken's 1,040 ids;
- tekken.json: tests/helpers/tiny_tekken.py's cut of the real vocabulary, version v7 (Voxtral's), its specials with
  [AUDIO] (24), [BEGIN_AUDIO] (25) and [TRANSCRIBE] (26) in place of fillers, and Voxtral's `audio` settings
  (16 kHz, 12.5 audio tokens a second, 128-bin log-mel every 160 samples over 400, 30 s chunks).
The encoder's and projector's weights are spread wide enough for a clip to move the text."""

from __future__ import annotations

import json
import os

from tests.helpers import tiny_models
from tests.helpers.tiny_tekken import special_tokens, write_tekken

AUDIO_TOKEN_ID, BEGIN_AUDIO_ID, TRANSCRIBE_ID = 24, 25, 26
NUM_SPECIAL, VOCAB = 40, 1000
AUDIO = dict(hidden_size=32, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2, num_mel_bins=128,
             max_source_positions=1500)
TEKKEN_AUDIO = {"sampling_rate": 16_000, "frame_rate": 12.5, "chunk_length_s": 30.0,
                "audio_encoding_config": {"num_mel_bins": 128, "hop_length": 160, "window_size": 400}}
FEATURE_EXTRACTOR = {"feature_extractor_type": "WhisperFeatureExtractor", "feature_size": 128, "sampling_rate": 16_000,
                     "hop_length": 160, "chunk_length": 30, "n_fft": 400, "n_samples": 480_000,
                     "nb_max_frames": 3000, "padding_side": "right", "padding_value": 0.0, "dither": 0.0,
                     "return_attention_mask": False, "processor_class": "VoxtralProcessor"}


def write_voxtral_tekken(folder: str | os.PathLike, *, audio: dict | None = None) -> str:
    """folder/tekken.json: the tiny tekken with Voxtral's audio tokens and `audio` settings (None: TEKKEN_AUDIO)."""
    path = write_tekken(folder, version="v7", vocab=VOCAB, num_special=NUM_SPECIAL)
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    names = {AUDIO_TOKEN_ID: "[AUDIO]", BEGIN_AUDIO_ID: "[BEGIN_AUDIO]", TRANSCRIBE_ID: "[TRANSCRIBE]"}
    data["special_tokens"] = [{**t, "token_str": names.get(t["rank"], t["token_str"])} for t in special_tokens()]
    data["audio"] = dict(TEKKEN_AUDIO if audio is None else audio)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f)
    return path


def make_tiny_voxtral(folder, *, seed: int = 0) -> str:
    import torch
    from transformers import VoxtralConfig, VoxtralForConditionalGeneration

    text = dict(model_type="llama", vocab_size=NUM_SPECIAL + VOCAB, hidden_size=64, intermediate_size=128,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                max_position_embeddings=4096, rms_norm_eps=1e-5, rope_theta=100_000_000.0, initializer_range=0.1,
                bos_token_id=1, eos_token_id=2, pad_token_id=11, tie_word_embeddings=False)
    config = VoxtralConfig(audio_config={"model_type": "voxtral_encoder", **AUDIO}, text_config=text,
                           audio_token_id=AUDIO_TOKEN_ID)
    config.architectures = ["VoxtralForConditionalGeneration"]
    torch.manual_seed(seed)
    model = VoxtralForConditionalGeneration(config).to(torch.float32)
    tiny_models._spread_vision(model, ("audio_tower", "multi_modal_projector"))
    with torch.no_grad():  # (VoxtralConfig's own initializer_range, 0.02, leaves the text near uniform)
        for name, param in model.named_parameters():
            if "language_model" in name and param.dim() == 2:
                param.normal_(0.0, 0.4)
    tiny_models._randomize_norms(model)
    os.makedirs(folder, exist_ok=True)
    model.save_pretrained(str(folder), safe_serialization=True)
    with open(os.path.join(folder, "generation_config.json"), "w", encoding="utf-8") as f:
        json.dump({"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 11}, f, indent=2)
    with open(os.path.join(folder, "preprocessor_config.json"), "w", encoding="utf-8") as f:
        json.dump(FEATURE_EXTRACTOR, f, indent=2)
    write_voxtral_tekken(folder)
    return str(folder)
