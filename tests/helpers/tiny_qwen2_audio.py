"""A tiny random Qwen2-Audio checkpoint (transformers' Qwen2AudioForConditionalGeneration) for
tests/models/test_qwen2_audio.py: a two-layer, 32-wide Whisper-style encoder over 128 mel bins (the released
max_source_positions 1500: the 30 s window), a two-layer Qwen2 language model, the tokenizer's `<|audio_bos|>`,
`<|AUDIO|>` and `<|audio_eos|>`, WhisperFeatureExtractor's preprocessor_config.json as Qwen2-Audio ships it, and
a chat template that writes `Audio N: <|audio_bos|><|AUDIO|><|audio_eos|>` for audio parts, as the released one
does. The encoder's and projector's weights are spread wide enough for a clip to move the text."""

from __future__ import annotations

import json
import os

from tests.helpers import tiny_models

AUDIO_TOKENS = ["<|audio_bos|>", "<|AUDIO|>", "<|audio_eos|>"]
AUDIO = dict(d_model=32, encoder_layers=2, encoder_attention_heads=2, encoder_ffn_dim=64, num_mel_bins=128,
             max_source_positions=1500)
FEATURE_EXTRACTOR = {"feature_extractor_type": "WhisperFeatureExtractor", "feature_size": 128, "sampling_rate": 16_000,
                     "hop_length": 160, "chunk_length": 30, "n_fft": 400, "n_samples": 480_000,
                     "nb_max_frames": 3000, "padding_side": "right", "padding_value": 0.0,
                     "return_attention_mask": True, "processor_class": "Qwen2AudioProcessor"}
CHAT_TEMPLATE = (
    "{% set clips = namespace(n=0) %}"
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}<|im_start|>system\nYou are a tiny test model.<|im_end|>\n"
    "{% endif %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'audio' %}{% set clips.n = clips.n + 1 %}"
    "Audio {{ clips.n }}: <|audio_bos|><|AUDIO|><|audio_eos|>\n"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def make_tiny_qwen2_audio(folder, *, seed: int = 0) -> str:
    import torch
    from tokenizers import AddedToken
    from transformers import Qwen2AudioConfig, Qwen2AudioForConditionalGeneration

    tok = tiny_models.build_tokenizer()
    tok.add_tokens([AddedToken(t, special=True, normalized=False) for t in AUDIO_TOKENS])
    text = dict(model_type="qwen2", vocab_size=tok.get_vocab_size(), hidden_size=64, intermediate_size=128,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                rms_norm_eps=1e-6, initializer_range=0.1, bos_token_id=1, eos_token_id=tiny_models.EOS_TOKEN_ID,
                pad_token_id=0, tie_word_embeddings=False)
    config = Qwen2AudioConfig(audio_config={"model_type": "qwen2_audio_encoder", **AUDIO}, text_config=text,
                              audio_token_index=tok.token_to_id("<|AUDIO|>"))
    config.architectures = ["Qwen2AudioForConditionalGeneration"]
    torch.manual_seed(seed)
    model = Qwen2AudioForConditionalGeneration(config).to(torch.float32)
    tiny_models._spread_vision(model, ("audio_tower", "multi_modal_projector"))
    tiny_models._randomize_norms(model)
    tiny_models._save(str(folder), model, tok, max_shard_size=None, generation=None)
    with open(os.path.join(folder, "preprocessor_config.json"), "w", encoding="utf-8") as f:
        json.dump(FEATURE_EXTRACTOR, f, indent=2)
    with open(os.path.join(folder, "tokenizer_config.json"), encoding="utf-8") as f:
        tok_config = json.load(f)
    tok_config["chat_template"] = CHAT_TEMPLATE
    with open(os.path.join(folder, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(tok_config, f, indent=2)
    return str(folder)
