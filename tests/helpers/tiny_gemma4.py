"""Tiny random Gemma 4 checkpoints (transformers' Gemma4ForCausalLM / Gemma4ForConditionalGeneration) for the
text tests (tests/models/test_gemma4.py) and the image tests (tests/models/test_gemma4_vision.py).

With images=True the multimodal checkpoint takes images and videos: the tokenizer gains Gemma 4's image, audio and
video tokens (`<|image>` / `<|image|>` / `<image|>`: begin, soft token, end), named in tokenizer_config.json as the
released tokenizer names them (image_token, boi_token, ...), a preprocessor_config.json for
Gemma4ImageProcessor (4-pixel patches pooled 3x3, at most 70 soft tokens an image), a
video_preprocessor_config.json for Gemma4VideoProcessor (the same patches, 70 soft tokens a frame, its defaults
otherwise), a chat template that writes the image (video) token for image (video) parts, and vision weights spread
wide enough for images to move the text.

With audio=True (implies images) it also has a tiny audio tower (AUDIO: a two-layer conformer over the feature
extractor's 128 mel bins, its projections clipped), a processor_config.json holding Gemma4AudioFeatureExtractor's
fields (its defaults) and Gemma4Processor's audio_seq_length / audio_ms_per_token, a chat template that writes the
audio token for audio parts, and audio weights spread as the vision ones are.
"""

from __future__ import annotations

import json
import os
from typing import Any

from tests.helpers import tiny_models

WINDOW = 16
LAYER_TYPES = ["sliding_attention", "sliding_attention", "full_attention"] * 2
# (token, tokenizer_config.json name, config.json id field)
MEDIA_TOKENS = [("<|image>", "boi_token", "boi_token_id"), ("<image|>", "eoi_token", "eoi_token_id"),
                ("<|image|>", "image_token", "image_token_id"), ("<|audio|>", "audio_token", "audio_token_id"),
                ("<|audio>", "boa_token", "boa_token_id"), ("<audio|>", "eoa_token", "eoa_token_index"),
                ("<|video|>", "video_token", "video_token_id")]
IMAGE_TEMPLATE = tiny_models.LLAVA_CHAT_TEMPLATE.replace("<image>\n", "<|image|>").replace(
    "{% elif part['type'] == 'text' %}", "{% elif part['type'] == 'video' %}<|video|>{% elif part['type'] == 'text' %}")
AUDIO_TEMPLATE = IMAGE_TEMPLATE.replace(
    "{% elif part['type'] == 'text' %}", "{% elif part['type'] == 'audio' %}<|audio|>{% elif part['type'] == 'text' %}")
# 128 first channels: transformers sizes the subsampling's projection from them (they must be the mel bins)
AUDIO = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, subsampling_conv_channels=[128, 8],
             conv_kernel_size=5, attention_chunk_size=12, attention_context_left=13, attention_context_right=0,
             output_proj_dims=48, use_clipped_linears=True)
FEATURE_EXTRACTOR = {"feature_extractor_type": "Gemma4AudioFeatureExtractor", "feature_size": 128,
                     "sampling_rate": 16_000, "padding_value": 0.0, "return_attention_mask": True,
                     "frame_length_ms": 20.0, "hop_length_ms": 10.0, "min_frequency": 0.0, "max_frequency": 8000.0,
                     "preemphasis": 0.0, "preemphasis_htk_flavor": True, "fft_overdrive": False, "dither": 0.0,
                     "input_scale_factor": 1.0, "mel_floor": 1e-3, "per_bin_mean": None, "per_bin_stddev": None}
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
              num_key_value_heads=2, head_dim=16, patch_size=4, pooling_kernel_size=3, position_embedding_size=64,
              rope_parameters={"rope_type": "axial", "rope_theta": 100.0})
PROCESSOR = {"image_processor_type": "Gemma4ImageProcessor", "do_convert_rgb": True, "do_resize": True,
             "resample": 3, "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": False,
             "image_mean": [0.0, 0.0, 0.0], "image_std": [1.0, 1.0, 1.0], "patch_size": 4, "pooling_kernel_size": 3,
             "max_soft_tokens": 70}
VIDEO_PROCESSOR = {"video_processor_type": "Gemma4VideoProcessor", "do_convert_rgb": True, "do_resize": True,
                   "resample": 3, "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
                   "image_mean": [0.0, 0.0, 0.0], "image_std": [1.0, 1.0, 1.0], "patch_size": 4,
                   "pooling_kernel_size": 3, "max_soft_tokens": 70, "num_frames": 32, "do_sample_frames": True}


def text_config(vocab: int, *, moe: bool = False, per_layer: bool = False, kv_shared: int = 0,
                bidirectional: str | None = None) -> dict:
    return dict(
        vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, global_head_dim=32, num_global_key_value_heads=1, attention_k_eq_v=True,
        sliding_window=WINDOW, layer_types=LAYER_TYPES, max_position_embeddings=512, final_logit_softcapping=30.0,
        hidden_size_per_layer_input=8 if per_layer else 0, vocab_size_per_layer_input=vocab,
        num_kv_shared_layers=kv_shared, use_double_wide_mlp=bool(kv_shared), enable_moe_block=moe,
        num_experts=4 if moe else None, top_k_experts=2 if moe else None, moe_intermediate_size=32 if moe else None,
        use_bidirectional_attention=bidirectional, initializer_range=0.1, rms_norm_eps=1e-6, tie_word_embeddings=True,
        bos_token_id=1, eos_token_id=tiny_models.EOS_TOKEN_ID, pad_token_id=0)


def _randomize(model) -> None:
    """Norms, layer scalars and the router's scales away from their init of 1, so each is tested."""
    import torch

    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("norm.weight", "router.scale", "per_expert_scale")):
                param.uniform_(0.5, 1.5)
            elif name.endswith("router.proj.weight"):
                param.normal_(0.0, 0.5)
        for name, buf in model.named_buffers():
            if name.endswith("layer_scalar"):
                buf.uniform_(0.5, 1.5)
            elif name.endswith("std_bias"):
                buf.normal_(0.0, 0.5)
            elif name.endswith("std_scale"):
                buf.uniform_(0.5, 1.5)
            elif name.endswith(("_min", "_max")):  # a clipped projection's bounds: near enough to clip some values
                low, high = (1.0, 1.5) if name.endswith(("output_min", "output_max")) else (2.0, 3.0)
                buf.uniform_(low, high).mul_(-1.0 if name.endswith("_min") else 1.0)


def make_tiny_gemma4(folder, *, conditional: bool = False, images: bool = False, seed: int = 0,
                     standardize: bool = False, clipped: bool = False, audio: bool = False, **kind: Any) -> str:
    """A Gemma4ForCausalLM, or (conditional) a Gemma4ForConditionalGeneration with a tiny vision tower; images:
    one that takes images (module docstring; implies conditional). standardize: the tower's std_bias /
    std_scale; clipped: its use_clipped_linears, with bounds that clip. audio: a tiny audio tower too (module
    docstring; implies images). `kind`: text_config's switches (moe, per_layer, kv_shared, bidirectional)."""
    import torch
    import transformers
    from tokenizers import AddedToken

    tok = tiny_models.build_tokenizer()
    ids: dict[str, int] = {}
    images = images or audio
    if images:
        conditional = True
        tok.add_tokens([AddedToken(t, special=True, normalized=False) for t, _, _ in MEDIA_TOKENS])
        ids = {field: tok.token_to_id(t) for t, _, field in MEDIA_TOKENS}
    text = text_config(tok.get_vocab_size(), **kind)
    torch.manual_seed(seed)
    if conditional:
        vision = {**VISION, "standardize": standardize, "use_clipped_linears": clipped}
        config = transformers.Gemma4Config(text_config=text, vision_config=vision,
                                           audio_config=dict(AUDIO) if audio else None, **ids)
        config.architectures = ["Gemma4ForConditionalGeneration"]
        model = transformers.Gemma4ForConditionalGeneration(config)
    else:
        config = transformers.Gemma4TextConfig(**text)
        config.architectures = ["Gemma4ForCausalLM"]
        model = transformers.Gemma4ForCausalLM(config)
    model = model.to(torch.float32)
    if images:
        tiny_models._spread_vision(model, ("vision_tower", "embed_vision"))
    if audio:
        tiny_models._spread_vision(model, ("audio_tower", "embed_audio"))
    _randomize(model)
    tiny_models._save(str(folder), model, tok, max_shard_size=None, generation=None)
    if images:
        _write_image_files(str(folder), AUDIO_TEMPLATE if audio else IMAGE_TEMPLATE)
    if audio:
        with open(os.path.join(str(folder), "processor_config.json"), "w", encoding="utf-8") as f:
            json.dump({"feature_extractor": FEATURE_EXTRACTOR, "audio_seq_length": 750, "audio_ms_per_token": 40},
                      f, indent=2)
    return str(folder)


def _write_image_files(folder: str, template: str = IMAGE_TEMPLATE) -> None:
    with open(os.path.join(folder, "preprocessor_config.json"), "w", encoding="utf-8") as f:
        json.dump(PROCESSOR, f, indent=2)
    with open(os.path.join(folder, "video_preprocessor_config.json"), "w", encoding="utf-8") as f:
        json.dump(VIDEO_PROCESSOR, f, indent=2)
    path = os.path.join(folder, "tokenizer_config.json")
    with open(path, encoding="utf-8") as f:
        tok_config = json.load(f)
    tok_config.update({name: token for token, name, _ in MEDIA_TOKENS})
    tok_config["chat_template"] = template
    with open(path, "w", encoding="utf-8") as f:
        json.dump(tok_config, f, indent=2)
