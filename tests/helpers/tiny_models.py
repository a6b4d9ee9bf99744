"""Tiny random models in a temp folder, laid out like a Hugging Face checkpoint.

Each builder writes config.json + safetensors (a transformers model with random init, saved with
save_pretrained), generation_config.json, a small byte-level BPE tokenizer.json trained here on
a fixed corpus, and tokenizer_config.json with a ChatML chat template. Shared by the model,
engine and server tests:

    folder = make_tiny_llama(tmp_path / "llama")
    llm = LLM(model=folder, ...)

Builders are deterministic for a given seed. transformers is imported lazily (seconds to import).
"""

from __future__ import annotations

import json
import os
from typing import Any

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a tiny test model.<|im_end|>\n' }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2
EOS_TOKEN_ID = 2

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Paris is the capital of France. Berlin is the capital of Germany.",
    "def add(a, b):\n    return a + b\n",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 123 2024 3.14159",
    "Unicode: café, naïve, Zürich, 東京, Москва, 🙂 emoji.",
    "Hello world! How are you today? I am fine, thank you.",
    "A tiny model for tests: it writes random tokens, but the same ones every time.",
] * 4


# qwen_tokens=True: Qwen3's added tokens that are text, not special (decoding keeps them), after the
# trained vocabulary: ids 384..387 with the default vocab_size.
QWEN_TEXT_TOKENS = ["<think>", "</think>", "<tool_call>", "</tool_call>"]


def build_tokenizer(vocab_size: int = 384, qwen_tokens: bool = False):
    """A byte-level BPE (GPT-2 style) trained on a fixed corpus; specials first (ids 0..2).
    qwen_tokens: QWEN_TEXT_TOKENS added as single tokens, as a reasoning / tool-calling Qwen has them."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_CORPUS, trainer=trainer)
    if qwen_tokens:
        tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in QWEN_TEXT_TOKENS])
    return tok


def _write_tokenizer(folder: str, tok) -> None:
    tok.save(os.path.join(folder, "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|im_start|>",
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": "<|endoftext|>",
        "chat_template": CHATML_TEMPLATE,
        "model_max_length": 2048,
        "add_bos_token": False,
    }
    with open(os.path.join(folder, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)


def _save(folder: str, model, tok, *, max_shard_size: str | None, generation: dict[str, Any] | None) -> str:
    os.makedirs(folder, exist_ok=True)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(folder, safe_serialization=True, **kwargs)
    _write_tokenizer(folder, tok)
    gen = {"eos_token_id": EOS_TOKEN_ID, "bos_token_id": 1, **(generation or {})}
    with open(os.path.join(folder, "generation_config.json"), "w", encoding="utf-8") as f:
        json.dump(gen, f, indent=2)
    # transformers may write chat_template.jinja or not depending on version; ours lives in tokenizer_config.
    return folder


def _common(tok, hidden_size, num_layers, num_heads, num_kv_heads, intermediate_size, max_position_embeddings,
            tie_word_embeddings) -> dict[str, Any]:
    return dict(
        vocab_size=tok.get_vocab_size(), hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings, tie_word_embeddings=tie_word_embeddings,
        bos_token_id=1, eos_token_id=EOS_TOKEN_ID, pad_token_id=0,
        # Wider init than a real model's 0.02, so random logits have clear winners and greedy
        # parity is not decided by float rounding between near-tied tokens.
        initializer_range=0.1, rms_norm_eps=1e-6,
    )


def make_tiny_llama(folder, *, hidden_size: int = 64, num_layers: int = 2, num_heads: int = 4, num_kv_heads: int = 2,
                    intermediate_size: int = 128, max_position_embeddings: int = 2048, rope_theta: float = 10000.0,
                    rope_scaling: dict[str, Any] | None = None, tie_word_embeddings: bool = False,
                    max_shard_size: str | None = None, seed: int = 0, generation: dict[str, Any] | None = None) -> str:
    """A Llama (GQA 4/2 by default). rope_scaling e.g. {"rope_type": "llama3", "factor": 8.0,
    "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64}."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = build_tokenizer()
    params = _common(tok, hidden_size, num_layers, num_heads, num_kv_heads, intermediate_size,
                     max_position_embeddings, tie_word_embeddings)
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": rope_theta}
    if rope_scaling:
        rope = {**rope_scaling, "rope_theta": rope_theta}
    config = LlamaConfig(**params, rope_parameters=rope)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.float32)
    return _save(str(folder), model, tok, max_shard_size=max_shard_size, generation=generation)


def make_tiny_mistral(folder, *, hidden_size: int = 64, num_layers: int = 2, num_heads: int = 4,
                      num_kv_heads: int = 2, intermediate_size: int = 128, max_position_embeddings: int = 2048,
                      sliding_window: int | None = 16, seed: int = 0) -> str:
    """A Mistral (v0.1's shape: every layer attends within sliding_window)."""
    import torch
    from transformers import MistralConfig, MistralForCausalLM

    tok = build_tokenizer()
    params = _common(tok, hidden_size, num_layers, num_heads, num_kv_heads, intermediate_size,
                     max_position_embeddings, False)
    config = MistralConfig(**params, sliding_window=sliding_window,
                           rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    torch.manual_seed(seed)
    model = MistralForCausalLM(config).to(torch.float32)
    return _save(str(folder), model, tok, max_shard_size=None, generation=None)


def make_tiny_qwen3(folder, *, hidden_size: int = 64, num_layers: int = 2, num_heads: int = 4, num_kv_heads: int = 2,
                    head_dim: int = 32, intermediate_size: int = 128, max_position_embeddings: int = 2048,
                    tie_word_embeddings: bool = True, max_shard_size: str | None = None, seed: int = 0,
                    generation: dict[str, Any] | None = None, qwen_tokens: bool = False) -> str:
    """A Qwen3 (per-head q/k RMSNorm; head_dim decoupled from hidden_size / num_heads); qwen_tokens:
    its tokenizer has Qwen3's `<think>` / `<tool_call>` tags as single tokens (build_tokenizer)."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    tok = build_tokenizer(qwen_tokens=qwen_tokens)
    params = _common(tok, hidden_size, num_layers, num_heads, num_kv_heads, intermediate_size,
                     max_position_embeddings, tie_word_embeddings)
    config = Qwen3Config(**params, head_dim=head_dim, rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config).to(torch.float32)
    _randomize_norms(model)
    return _save(str(folder), model, tok, max_shard_size=max_shard_size, generation=generation)


def make_tiny_qwen2(folder, *, hidden_size: int = 64, num_layers: int = 2, num_heads: int = 4, num_kv_heads: int = 2,
                    intermediate_size: int = 128, max_position_embeddings: int = 2048,
                    tie_word_embeddings: bool = False, seed: int = 0) -> str:
    """A Qwen2 (bias on q/k/v)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tok = build_tokenizer()
    params = _common(tok, hidden_size, num_layers, num_heads, num_kv_heads, intermediate_size,
                     max_position_embeddings, tie_word_embeddings)
    config = Qwen2Config(**params, rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config).to(torch.float32)
    with torch.no_grad():  # HF inits biases at 0; make them matter
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0.0, 0.1)
    return _save(str(folder), model, tok, max_shard_size=None, generation=None)


def make_tiny_phi3(folder, *, hidden_size: int = 64, num_layers: int = 2, num_heads: int = 4, num_kv_heads: int = 2,
                   intermediate_size: int = 128, max_position_embeddings: int = 2048, sliding_window: int | None = None,
                   tie_word_embeddings: bool = False, seed: int = 0, **config_fields: Any) -> str:
    """A Phi-3 (fused qkv_proj and gate_up_proj in the checkpoint; GQA 4/2 by default, which real
    Phi-3s do not use but which makes the q/k/v row split uneven). config_fields go to Phi3Config
    (e.g. rope_parameters, partial_rotary_factor) and so into config.json."""
    import torch
    from transformers import Phi3Config, Phi3ForCausalLM

    tok = build_tokenizer()
    params = _common(tok, hidden_size, num_layers, num_heads, num_kv_heads, intermediate_size,
                     max_position_embeddings, tie_word_embeddings)
    config_fields.setdefault("rope_parameters", {"rope_type": "default", "rope_theta": 10000.0})
    config_fields.setdefault("original_max_position_embeddings", max_position_embeddings)
    config = Phi3Config(**params, sliding_window=sliding_window, resid_pdrop=0.1, embd_pdrop=0.1,
                        attention_dropout=0.1, **config_fields)
    torch.manual_seed(seed)
    model = Phi3ForCausalLM(config).to(torch.float32)
    _randomize_norms(model)
    return _save(str(folder), model, tok, max_shard_size=None, generation=None)


def make_tiny_gemma2(folder, *, hidden_size: int = 64, num_layers: int = 2, num_heads: int = 4, num_kv_heads: int = 2,
                     head_dim: int = 32, intermediate_size: int = 128, max_position_embeddings: int = 256,
                     sliding_window: int = 128, query_pre_attn_scalar: int = 24, attn_softcap: float | None = 2.0,
                     final_softcap: float | None = 3.0, seed: int = 0) -> str:
    """A Gemma 2 (four norms a layer, GELU-tanh MLP, tied embedding scaled by sqrt(hidden)); softcaps
    small enough that they bend these random models' scores and logits, and an attention scale of its
    own (query_pre_attn_scalar, not head_dim)."""
    import torch
    from transformers import Gemma2Config, Gemma2ForCausalLM

    tok = build_tokenizer()
    params = _common(tok, hidden_size, num_layers, num_heads, num_kv_heads, intermediate_size,
                     max_position_embeddings, True)
    config = Gemma2Config(**params, head_dim=head_dim, sliding_window=sliding_window,
                          query_pre_attn_scalar=query_pre_attn_scalar, attn_logit_softcapping=attn_softcap,
                          final_logit_softcapping=final_softcap, hidden_activation="gelu_pytorch_tanh",
                          rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    torch.manual_seed(seed)
    model = Gemma2ForCausalLM(config).to(torch.float32)
    _randomize_norms(model)
    return _save(str(folder), model, tok, max_shard_size=None, generation=None)


def make_tiny_gemma3(folder, *, hidden_size: int = 64, num_layers: int = 6, num_heads: int = 4, num_kv_heads: int = 2,
                     head_dim: int = 32, intermediate_size: int = 128, max_position_embeddings: int = 512,
                     sliding_window: int = 16, query_pre_attn_scalar: int = 24, global_scaling: dict | None = None,
                     seed: int = 0) -> str:
    """A Gemma 3 text model (q/k norms; five local layers per global one, local and global RoPE apart:
    10,000 unscaled and 1,000,000 with `global_scaling`)."""
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    tok = build_tokenizer()
    params = _common(tok, hidden_size, num_layers, num_heads, num_kv_heads, intermediate_size,
                     max_position_embeddings, True)
    full = {"rope_type": "default", "rope_theta": 1_000_000.0, **(global_scaling or {})}
    config = Gemma3TextConfig(**params, head_dim=head_dim, sliding_window=sliding_window,
                              query_pre_attn_scalar=query_pre_attn_scalar, hidden_activation="gelu_pytorch_tanh",
                              rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                                               "full_attention": full})
    config.architectures = ["Gemma3ForCausalLM"]
    torch.manual_seed(seed)
    model = Gemma3ForCausalLM(config).to(torch.float32)
    _randomize_norms(model)
    return _save(str(folder), model, tok, max_shard_size=None, generation=None)


def make_tiny_gemma3_multimodal(folder, *, sliding_window: int = 16, seed: int = 0) -> str:
    """A Gemma 3 multimodal checkpoint (Gemma3ForConditionalGeneration: a tiny SigLIP vision tower and
    projector beside the language model, saved under transformers' current tensor names)."""
    import torch
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    tok = build_tokenizer()
    text = dict(vocab_size=tok.get_vocab_size(), hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
                sliding_window=sliding_window, query_pre_attn_scalar=24, initializer_range=0.1,
                bos_token_id=1, eos_token_id=EOS_TOKEN_ID, pad_token_id=0)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)
    config = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                          image_token_index=tok.get_vocab_size() - 1, boi_token_index=3, eoi_token_index=4)
    config.architectures = ["Gemma3ForConditionalGeneration"]
    torch.manual_seed(seed)
    model = Gemma3ForConditionalGeneration(config).to(torch.float32)
    _randomize_norms(model)
    return _save(str(folder), model, tok, max_shard_size=None, generation=None)


# A chat template that prints each part of a message (vLLM's "openai" content format), as llava-hf's do.
LLAVA_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'image' %}<image>\n"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def make_tiny_llava(folder, *, text: str = "llama", vision: str = "clip", image_size: int = 56,
                    seed: int = 0) -> str:
    """A LLaVA checkpoint (LlavaForConditionalGeneration): a tiny CLIP (llava-1.5's layout: feature layer -2,
    class token dropped) or SigLIP ("full" strategy, last layer) tower, the projector, and a Llama or Qwen2
    language model; `<image>` is the last token of the vocabulary; preprocessor_config.json for the
    tower's image size; a chat template that writes `<image>` for image parts."""
    import torch
    from tokenizers import AddedToken
    from transformers import (
        CLIPImageProcessor,
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        Qwen2Config,
        SiglipImageProcessor,
        SiglipVisionConfig,
    )

    tok = build_tokenizer()
    tok.add_tokens([AddedToken("<image>", special=True, normalized=False)])
    image_token = tok.token_to_id("<image>")
    params = _common(tok, 64, 2, 4, 2, 128, 2048, False)
    text_config = LlamaConfig(**params) if text == "llama" else Qwen2Config(**params)
    tower = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2,
                 image_size=image_size, patch_size=14)
    if vision == "clip":
        vision_config: Any = CLIPVisionConfig(**tower)
        processor: Any = CLIPImageProcessor(size={"shortest_edge": image_size},
                                            crop_size={"height": image_size, "width": image_size})
        layer, strategy = -2, "default"
    else:
        vision_config = SiglipVisionConfig(**tower)
        processor = SiglipImageProcessor(size={"height": image_size, "width": image_size})
        layer, strategy = -1, "full"
    config = LlavaConfig(vision_config=vision_config, text_config=text_config, image_token_index=image_token,
                         vision_feature_layer=layer, vision_feature_select_strategy=strategy,
                         projector_hidden_act="gelu")
    config.architectures = ["LlavaForConditionalGeneration"]
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(config).to(torch.float32)
    _spread_vision(model, ("vision_tower", "multi_modal_projector"))
    _randomize_norms(model)
    _save(str(folder), model, tok, max_shard_size=None, generation=None)
    processor.save_pretrained(str(folder))
    with open(os.path.join(folder, "tokenizer_config.json"), encoding="utf-8") as f:
        tok_config = json.load(f)
    tok_config["chat_template"] = LLAVA_CHAT_TEMPLATE
    with open(os.path.join(folder, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(tok_config, f, indent=2)
    return str(folder)


GEMMA3_VISION_TOKENS = ["<start_of_image>", "<end_of_image>", "<image_soft_token>"]


def make_tiny_gemma3_vision(folder, *, sliding_window: int = 16, seed: int = 0) -> str:
    """A Gemma 3 multimodal checkpoint that takes images: the tokenizer has `<start_of_image>`,
    `<end_of_image>` and `<image_soft_token>` as special tokens, a 56-pixel SigLIP tower of 4x4 patches
    pooled to 4 tokens an image, Gemma3ImageProcessor's preprocessor_config.json, and a chat template that
    writes `<start_of_image>` for image parts; six layers, five of them windowed."""
    import torch
    from tokenizers import AddedToken
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    tok = build_tokenizer()
    tok.add_tokens([AddedToken(t, special=True, normalized=False) for t in GEMMA3_VISION_TOKENS])
    boi, eoi, soft = (tok.token_to_id(t) for t in GEMMA3_VISION_TOKENS)
    text = dict(vocab_size=tok.get_vocab_size(), hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
                sliding_window=sliding_window, query_pre_attn_scalar=24, initializer_range=0.1,
                bos_token_id=1, eos_token_id=EOS_TOKEN_ID, pad_token_id=0)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=56,
                  patch_size=14)
    config = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4, image_token_index=soft,
                          boi_token_index=boi, eoi_token_index=eoi)
    config.architectures = ["Gemma3ForConditionalGeneration"]
    torch.manual_seed(seed)
    model = Gemma3ForConditionalGeneration(config).to(torch.float32)
    _spread_vision(model, ("vision_tower", "multi_modal_projector"), centred=("soft_emb_norm",))
    _randomize_norms(model)
    _save(str(folder), model, tok, max_shard_size=None, generation=None)
    processor = {"image_processor_type": "Gemma3ImageProcessor", "do_resize": True,
                 "size": {"height": 56, "width": 56}, "resample": 2, "do_rescale": True, "rescale_factor": 1 / 255,
                 "do_normalize": True, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
                 "do_convert_rgb": True, "do_pan_and_scan": False}
    with open(os.path.join(folder, "preprocessor_config.json"), "w", encoding="utf-8") as f:
        json.dump(processor, f, indent=2)
    with open(os.path.join(folder, "tokenizer_config.json"), encoding="utf-8") as f:
        tok_config = json.load(f)
    tok_config["chat_template"] = LLAVA_CHAT_TEMPLATE.replace("<image>\n", "<start_of_image>")
    with open(os.path.join(folder, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(tok_config, f, indent=2)
    return str(folder)


QWEN_VL_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>"]


def make_tiny_qwen2_vl(folder, *, version: str = "qwen2_vl", seed: int = 0) -> str:
    """A Qwen2-VL (or Qwen2.5-VL: version "qwen2_5_vl") checkpoint: a tiny Qwen2 with multimodal RoPE
    (16-dim heads: mrope_section [2, 3, 3]), a two-block vision transformer of 14-pixel patches merged 2x2
    (2.5: windowed, block 1 full), the tokenizer's vision tokens, Qwen2VLImageProcessor's
    preprocessor_config.json (small min/max pixels: images of a few merged patches), and a chat template that
    writes `<|vision_start|><|image_pad|><|vision_end|>` for image parts."""
    import torch
    from tokenizers import AddedToken
    from transformers import (
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
        Qwen2VLConfig,
        Qwen2VLForConditionalGeneration,
    )

    tok = build_tokenizer()
    tok.add_tokens([AddedToken(t, special=True, normalized=False) for t in QWEN_VL_TOKENS])
    start, end, pad = (tok.token_to_id(t) for t in QWEN_VL_TOKENS)
    text = dict(vocab_size=tok.get_vocab_size(), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048, rms_norm_eps=1e-6,
                initializer_range=0.1, bos_token_id=1, eos_token_id=EOS_TOKEN_ID, pad_token_id=0,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]})
    if version == "qwen2_vl":
        vision: dict[str, Any] = dict(depth=2, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2, patch_size=14,
                                      spatial_merge_size=2, temporal_patch_size=2)
        config: Any = Qwen2VLConfig(text_config=text, vision_config=vision, image_token_id=pad,
                                    vision_start_token_id=start, vision_end_token_id=end)
        config.architectures = ["Qwen2VLForConditionalGeneration"]
        model_cls: Any = Qwen2VLForConditionalGeneration
    else:
        vision = dict(depth=2, hidden_size=32, out_hidden_size=64, intermediate_size=48, num_heads=2, patch_size=14,
                      spatial_merge_size=2, temporal_patch_size=2, window_size=56, fullatt_block_indexes=[1])
        config = Qwen2_5_VLConfig(text_config=text, vision_config=vision, image_token_id=pad,
                                  vision_start_token_id=start, vision_end_token_id=end)
        config.architectures = ["Qwen2_5_VLForConditionalGeneration"]
        model_cls = Qwen2_5_VLForConditionalGeneration
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32)
    _spread_vision(model, ("visual",), scale=lambda name, param: param.dim() == 1 and name.endswith("weight"))
    _randomize_norms(model)
    _save(str(folder), model, tok, max_shard_size=None, generation=None)
    processor = {"image_processor_type": "Qwen2VLImageProcessor", "do_resize": True, "resample": 3,
                 "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
                 "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711],
                 "do_convert_rgb": True, "min_pixels": 56 * 56, "max_pixels": 28 * 28 * 16, "patch_size": 14,
                 "temporal_patch_size": 2, "merge_size": 2}
    with open(os.path.join(folder, "preprocessor_config.json"), "w", encoding="utf-8") as f:
        json.dump(processor, f, indent=2)
    with open(os.path.join(folder, "tokenizer_config.json"), encoding="utf-8") as f:
        tok_config = json.load(f)
    tok_config["chat_template"] = LLAVA_CHAT_TEMPLATE.replace("<image>\n", "<|vision_start|><|image_pad|><|vision_end|>")
    with open(os.path.join(folder, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(tok_config, f, indent=2)
    return str(folder)


def make_tiny_granite(folder, *, hidden_size: int = 64, num_layers: int = 2, num_heads: int = 4, num_kv_heads: int = 2,
                      intermediate_size: int = 128, max_position_embeddings: int = 2048,
                      tie_word_embeddings: bool = False, embedding_multiplier: float = 12.0,
                      residual_multiplier: float = 0.22, attention_multiplier: float = 0.0078125,
                      logits_scaling: float = 8.0, attention_bias: bool = False, seed: int = 0) -> str:
    """A Granite 3.x (dense): Llama with embedding / residual / attention multipliers and logits
    scaling, by default far from 1 (and the softmax scale far from head_dim ** -0.5) so that a
    multiplier applied wrong, or not at all, changes the tokens. attention_bias: q/k/v and o_proj
    biases (random), so the o_proj bias fold is tested."""
    import torch
    from transformers import GraniteConfig, GraniteForCausalLM

    tok = build_tokenizer()
    params = _common(tok, hidden_size, num_layers, num_heads, num_kv_heads, intermediate_size,
                     max_position_embeddings, tie_word_embeddings)
    config = GraniteConfig(**params, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                           embedding_multiplier=embedding_multiplier, residual_multiplier=residual_multiplier,
                           attention_multiplier=attention_multiplier, logits_scaling=logits_scaling,
                           attention_bias=attention_bias)
    torch.manual_seed(seed)
    model = GraniteForCausalLM(config).to(torch.float32)
    _randomize_norms(model)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("_proj.bias"):  # HF inits biases at 0; make them matter
                param.normal_(0.0, 0.1)
            elif name.endswith("o_proj.weight") or name.endswith("down_proj.weight"):
                # The multipliers grow the embedding (x12) and shrink each layer's update (x0.22):
                # wider projections and a narrower embedding keep the layers' part of the logits
                # (the attention scale's included) large enough to decide tokens.
                param.mul_(4.0)
            elif name == "model.embed_tokens.weight":
                param.mul_(0.25)
    return _save(str(folder), model, tok, max_shard_size=None, generation=None)


def _moe_model(config_cls, model_cls, tok, seed: int, *, router_std: float, **params):
    """A random MoE model: norms randomized, and a wider router so its top-k choices are far from
    ties (a near-tie would let float noise, not the code, decide the greedy tokens)."""
    import torch

    config = config_cls(**params, rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32)
    _randomize_norms(model)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("mlp.gate.weight", "block_sparse_moe.gate.weight")):
                param.normal_(0.0, router_std)
            elif name.endswith("_proj.bias"):  # HF inits biases at 0; make them matter
                param.normal_(0.0, 0.1)
    return model


def make_tiny_qwen3_moe(folder, *, hidden_size: int = 64, num_layers: int = 3, num_heads: int = 4,
                        num_kv_heads: int = 2, head_dim: int = 32, num_experts: int = 8, top_k: int = 4,
                        moe_intermediate_size: int = 32, intermediate_size: int = 96, norm_topk_prob: bool = True,
                        mlp_only_layers: tuple[int, ...] = (1,), tie_word_embeddings: bool = False,
                        seed: int = 0) -> str:
    """A Qwen3-MoE (q/k norm, renormalised top-k); layer 1 dense (mlp_only_layers) by default."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    tok = build_tokenizer()
    params = _common(tok, hidden_size, num_layers, num_heads, num_kv_heads, intermediate_size, 2048,
                     tie_word_embeddings)
    model = _moe_model(Qwen3MoeConfig, Qwen3MoeForCausalLM, tok, seed, router_std=0.5, **params, head_dim=head_dim,
                       num_experts=num_experts, num_experts_per_tok=top_k, moe_intermediate_size=moe_intermediate_size,
                       norm_topk_prob=norm_topk_prob, mlp_only_layers=list(mlp_only_layers))
    return _save(str(folder), model, tok, max_shard_size=None, generation=None)


def make_tiny_qwen2_moe(folder, *, hidden_size: int = 64, num_layers: int = 2, num_heads: int = 4,
                        num_kv_heads: int = 2, num_experts: int = 6, top_k: int = 2, moe_intermediate_size: int = 32,
                        shared_expert_intermediate_size: int = 48, intermediate_size: int = 96,
                        norm_topk_prob: bool = False, seed: int = 0) -> str:
    """A Qwen2-MoE (q/k/v bias, a shared expert with a sigmoid gate, top-k weights not renormalised)."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    tok = build_tokenizer()
    params = _common(tok, hidden_size, num_layers, num_heads, num_kv_heads, intermediate_size, 2048, False)
    model = _moe_model(Qwen2MoeConfig, Qwen2MoeForCausalLM, tok, seed, router_std=0.5, **params,
                       num_experts=num_experts, num_experts_per_tok=top_k, moe_intermediate_size=moe_intermediate_size,
                       shared_expert_intermediate_size=shared_expert_intermediate_size, norm_topk_prob=norm_topk_prob)
    return _save(str(folder), model, tok, max_shard_size=None, generation=None)


def make_tiny_mixtral(folder, *, hidden_size: int = 64, num_layers: int = 2, num_heads: int = 4, num_kv_heads: int = 2,
                      num_experts: int = 4, top_k: int = 2, intermediate_size: int = 48,
                      max_shard_size: str | None = None, seed: int = 0) -> str:
    """A Mixtral (block_sparse_moe.experts.{e}.w1/w2/w3, top-k weights always renormalised)."""
    from transformers import MixtralConfig, MixtralForCausalLM

    tok = build_tokenizer()
    params = _common(tok, hidden_size, num_layers, num_heads, num_kv_heads, intermediate_size, 2048, False)
    model = _moe_model(MixtralConfig, MixtralForCausalLM, tok, seed, router_std=0.5, **params,
                       num_local_experts=num_experts, num_experts_per_tok=top_k)
    return _save(str(folder), model, tok, max_shard_size=max_shard_size, generation=None)


def _is_scale(name: str, param: Any) -> bool:
    return param.dim() == 1 and "norm" in name and name.endswith("weight")


def _spread_vision(model, parts: tuple[str, ...], *, scale: Any = _is_scale, vector_std: float = 0.05,
                   centred: tuple[str, ...] = ()) -> None:
    """The default init leaves a vision tower's output (and so the image rows) near zero: wider random weights
    under the names holding `parts` give images a say in the tests. Scales (`scale`) drawn around 1 (around 0
    for `centred` names, which the model adds 1 to), other matrices N(0, 0.2), other vectors N(0, vector_std)."""
    import torch

    with torch.no_grad():
        for name, param in model.named_parameters():
            if not any(part in name for part in parts):
                continue
            if scale(name, param):
                param.uniform_(-0.5, 0.5) if any(c in name for c in centred) else param.uniform_(0.5, 1.5)
            else:
                param.normal_(0.0, 0.2 if param.dim() > 1 else vector_std)


def _randomize_norms(model) -> None:
    """HF inits norm weights at 1; random ones make the q/k-norm weights actually tested."""
    import torch

    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)


# llama.cpp's names for Gemma's four norms (its ffn_norm is the pre-feedforward one there).
GEMMA_NORMS = {"post_attention_layernorm.weight": "post_attention_norm.weight",
               "pre_feedforward_layernorm.weight": "ffn_norm.weight",
               "post_feedforward_layernorm.weight": "post_ffw_norm.weight"}


def export_gguf(folder, path, *, tensor_type: str = "F32", rope_freqs: list[float] | None = None) -> str:
    """Write a tiny folder (make_tiny_llama / _qwen2 / _qwen3) as a llama.cpp-style GGUF: llama.cpp
    tensor names, for llama attn_q/attn_k rows permuted the way llama.cpp's converter does, a
    "gpt2" tokenizer from tokenizer.json, the chat template. tensor_type "F32" | "F16" | "Q8_0" |
    "Q4_0" | "Q4_1" (2-D weights only, quantized by the gguf package) or "Q4_K" | "Q6_K" (which the
    gguf package cannot quantize: random valid blocks of weight scale ~0.02 replace the folder's
    2-D weights, so such a file is its own reference; columns must be multiples of 256); rope_freqs: per-frequency divisors stored as rope_freqs.weight (Llama 3.1)."""
    import gguf
    import numpy as np
    from safetensors.numpy import load_file

    folder = str(folder)
    with open(os.path.join(folder, "config.json"), encoding="utf-8") as f:
        cfg = json.load(f)
    with open(os.path.join(folder, "tokenizer.json"), encoding="utf-8") as f:
        tok_json = json.load(f)
    arch = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3",
            "Qwen2MoeForCausalLM": "qwen2moe", "Qwen3MoeForCausalLM": "qwen3moe", "MixtralForCausalLM": "llama",
            "Phi3ForCausalLM": "phi3", "GraniteForCausalLM": "granite", "Gemma2ForCausalLM": "gemma2",
            "Gemma3ForCausalLM": "gemma3"}[
        cfg["architectures"][0]]
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads

    def permute(w: np.ndarray, n: int) -> np.ndarray:
        return w.reshape(n, 2, w.shape[0] // n // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    layer = {"input_layernorm.weight": "attn_norm.weight", "self_attn.q_proj.weight": "attn_q.weight",
             "self_attn.k_proj.weight": "attn_k.weight", "self_attn.v_proj.weight": "attn_v.weight",
             "self_attn.o_proj.weight": "attn_output.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
             "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
             "mlp.down_proj.weight": "ffn_down.weight", "self_attn.q_proj.bias": "attn_q.bias",
             "self_attn.k_proj.bias": "attn_k.bias", "self_attn.v_proj.bias": "attn_v.bias",
             "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
             # Mixture of experts (Mixtral's block_sparse_moe is renamed to mlp first).
             "mlp.gate.weight": "ffn_gate_inp.weight", "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
             "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
             "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
             "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight",
             # Phi-3 keeps its fused projections in llama.cpp's files too.
             "self_attn.qkv_proj.weight": "attn_qkv.weight", "mlp.gate_up_proj.weight": "ffn_up.weight"}
    # Routed experts: llama.cpp stacks each layer's into one [experts, rows, cols] tensor.
    stacks = {"gate_proj": "ffn_gate_exps.weight", "w1": "ffn_gate_exps.weight", "up_proj": "ffn_up_exps.weight",
              "w3": "ffn_up_exps.weight", "down_proj": "ffn_down_exps.weight", "w2": "ffn_down_exps.weight"}
    tensors: dict[str, np.ndarray] = {}
    for file in sorted(f for f in os.listdir(folder) if f.endswith(".safetensors")):
        tensors.update(load_file(os.path.join(folder, file)))

    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"tiny-{arch}")
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    rope = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    if arch == "phi3":  # as llama.cpp's Phi-3 converter: the rotary dims, no key length; LongRoPE tensors
        partial = rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
        w.add_rope_dimension_count(int(partial * head_dim))
        w.add_rope_scaling_orig_ctx_len(cfg.get("original_max_position_embeddings") or cfg["max_position_embeddings"])
        w.add_sliding_window(cfg.get("sliding_window") or 0)
        if rope.get("rope_type") == "longrope":
            w.add_tensor("rope_factors_long.weight", np.asarray(rope["long_factor"], dtype=np.float32))
            w.add_tensor("rope_factors_short.weight", np.asarray(rope["short_factor"], dtype=np.float32))
    else:
        w.add_rope_dimension_count(head_dim)
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    if arch in ("gemma2", "gemma3"):  # as llama.cpp's Gemma converters write them
        for key in ("attn_logit_softcapping", "final_logit_softcapping"):
            if cfg.get(key):
                getattr(w, f"add_{key}")(cfg[key])
        w.add_sliding_window(cfg["sliding_window"])
        full = rope.get("full_attention", rope)
        if full.get("rope_type") == "linear":
            w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            w.add_rope_scaling_factor(float(full["factor"]))
    if arch == "granite":  # llama.cpp's names for Granite's multipliers
        w.add_embedding_scale(cfg["embedding_multiplier"])
        w.add_residual_scale(cfg["residual_multiplier"])
        w.add_attention_scale(cfg["attention_multiplier"])
        w.add_logit_scale(cfg["logits_scaling"])
    rope_params = cfg.get("rope_parameters") or {}
    rope_params = rope_params.get("full_attention", rope_params)  # Gemma 3: the global layers' base
    w.add_rope_freq_base(float(rope_params.get("rope_theta", cfg.get("rope_theta", 1e4))))
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    if rope.get("rope_type") == "yarn":  # as llama.cpp's converter writes Qwen's YaRN
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(float(rope["factor"]))
        w.add_rope_scaling_orig_ctx_len(int(rope["original_max_position_embeddings"]))
    num_experts = cfg.get("num_experts") or cfg.get("num_local_experts")
    if num_experts:
        w.add_expert_count(num_experts)
        w.add_expert_used_count(cfg["num_experts_per_tok"])
        if cfg.get("moe_intermediate_size"):
            w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
        if cfg.get("shared_expert_intermediate_size"):
            w.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])
        experts: dict[tuple[str, str], dict[int, np.ndarray]] = {}
        for hf_name in [n for n in tensors if ".experts." in n]:
            parts = hf_name.split(".")  # model.layers.N.<mlp|block_sparse_moe>.experts.E.<proj>.weight
            experts.setdefault((parts[2], stacks[parts[6]]), {})[int(parts[5])] = tensors.pop(hf_name)
        for (layer_index, stack), by_expert in experts.items():
            tensors[f"__stack__.{layer_index}.{stack}"] = np.stack([by_expert[e] for e in sorted(by_expert)])
    w.add_vocab_size(cfg["vocab_size"])
    write_gguf_vocab(w, tok_json)
    qtype = gguf.GGMLQuantizationType[tensor_type]
    for hf_name, arr in tensors.items():
        if hf_name in names:
            name = names[hf_name]
        elif hf_name.startswith("__stack__."):
            _, layer_index, stack = hf_name.split(".", 2)
            name = f"blk.{layer_index}.{stack}"
        else:
            parts = hf_name.replace(".block_sparse_moe.", ".mlp.").split(".")  # model.layers.N.<rest>
            names_here = {**layer, **GEMMA_NORMS} if arch in ("gemma2", "gemma3") else layer
            name = f"blk.{parts[2]}.{names_here['.'.join(parts[3:])]}"
            if name.endswith("ffn_gate_inp_shexp.weight"):
                arr = arr.reshape(-1)  # a vector in llama.cpp's files
        arr = arr.astype(np.float32)
        if arch in ("gemma2", "gemma3") and name.endswith("norm.weight"):
            arr = arr + np.float32(1.0)  # llama.cpp's Gemma converters store 1 + w
        if arch in ("llama", "granite") and name.endswith("attn_q.weight"):
            arr = permute(arr, heads)
        elif arch in ("llama", "granite") and name.endswith("attn_k.weight"):
            arr = permute(arr, kv_heads)
        if arr.ndim == 2 and tensor_type in ("Q4_K", "Q6_K"):
            seed = sum(name.encode())
            w.add_tensor(name, random_kquant_blocks(tensor_type, *arr.shape, seed=seed), raw_dtype=qtype)
        elif arr.ndim == 2 and qtype != gguf.GGMLQuantizationType.F32:
            w.add_tensor(name, gguf.quants.quantize(arr, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(name, arr)
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", np.asarray(rope_freqs, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def write_gguf_vocab(w, tok_json: dict[str, Any]) -> None:
    """The tiny folders' tokenizer.json as a "gpt2" (byte-level BPE) GGUF vocabulary, with their special ids and
    chat template, as llama.cpp's converter writes one."""
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt2")
    vocab = tok_json["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.get)
    w.add_token_list(tokens)
    w.add_token_types([3 if t in SPECIAL_TOKENS else 1 for t in tokens])
    w.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in tok_json["model"]["merges"]])
    w.add_bos_token_id(1)
    w.add_eos_token_id(EOS_TOKEN_ID)
    w.add_pad_token_id(0)
    w.add_add_bos_token(False)
    w.add_chat_template(CHATML_TEMPLATE)


def random_kquant_blocks(tensor_type: str, rows: int, cols: int, *, seed: int = 0):
    """Random but valid Q4_K / Q6_K blocks, uint8 [rows, bytes per row]: random quants and
    sub-block scales, with the fp16 super-block scales set so weights stay around +-0.04
    (Q4_K: d*sc*q - dmin*m, sc and m 6-bit, q 4-bit; Q6_K: d*sc*(q - 32), sc int8, q 6-bit)."""
    import gguf
    import numpy as np

    qtype = gguf.GGMLQuantizationType[tensor_type]
    block, size = gguf.constants.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)

    def f16(value: float):
        return np.full((rows, cols // block), value, dtype=np.float16).view(np.uint8).reshape(rows, cols // block, 2)

    if tensor_type == "Q4_K":  # d, dmin lead the block
        raw[..., 0:2] = f16(0.04 / (63 * 15))
        raw[..., 2:4] = f16(0.02 / 63)
    else:  # Q6_K: d ends the block
        raw[..., size - 2:size] = f16(0.04 / (128 * 32))
    return raw.reshape(rows, -1)


def load_float32(folder: str, **kw: Any) -> Any:
    """A ferrox model of `folder`, float32 on the CPU (kw: load_model's own, e.g. quant_config)."""
    import torch
    from ferrox.loader.model_loader import load_model, load_model_spec
    from ferrox.loader.source import resolve_model

    source = resolve_model(folder)
    return load_model(source, load_model_spec(source), dtype=torch.float32, device="cpu", **kw)


def models_with_references(root, builders: dict[str, Any],
                           references: dict[str, str] | None = None) -> dict[str, tuple[str, Any, Any]]:
    """name -> (folder, ferrox model, transformers model), both float32 on the CPU, for each
    `builders[name](root / name)` (the model tests' module fixtures: each family built once).
    references: name -> the transformers class to load it with (default AutoModelForCausalLM)."""
    import torch
    import transformers

    out = {}
    for name, build in builders.items():
        folder = build(root / name)
        cls = getattr(transformers, (references or {}).get(name, "AutoModelForCausalLM"))
        out[name] = (folder, load_float32(folder), cls.from_pretrained(folder, dtype=torch.float32).eval())
    return out


IDEFICS3_TOKENS = (["<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>"]
                   + [f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)])


def make_tiny_idefics3(folder, *, architecture: str = "Idefics3ForConditionalGeneration",
                       do_image_splitting: bool = True, seed: int = 0) -> str:
    """An Idefics3 (or SmolVLM) checkpoint: a 36-pixel tower of 6x6 patches (1/6 is inexact, so the
    tower's bucketed positions are exercised), pixel shuffle by 2 (9 rows a tile) and a Llama; the
    tokenizer has Idefics3Processor's tokens (`<image>`, `<fake_token_around_image>`, `<global-img>`,
    `<row_r_col_c>`); Idefics3ImageProcessor's preprocessor_config.json (36-pixel tiles, images resized
    to a 72-pixel longest edge: up to 2x2 tiles and the global one) and the processor_config.json
    Idefics3Processor writes; a chat template that writes `<image>` for image parts."""
    import shutil
    import tempfile

    import torch
    from tokenizers import AddedToken
    from transformers import (
        Idefics3Config,
        Idefics3ForConditionalGeneration,
        Idefics3Processor,
        LlamaConfig,
        PreTrainedTokenizerFast,
        SmolVLMConfig,
        SmolVLMForConditionalGeneration,
    )
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    tok = build_tokenizer()
    tok.add_tokens([AddedToken(t, special=True, normalized=False) for t in IDEFICS3_TOKENS])
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=36,
                  patch_size=6)
    smol = architecture == "SmolVLMForConditionalGeneration"
    config_cls: Any = SmolVLMConfig if smol else Idefics3Config
    config = config_cls(text_config=LlamaConfig(**_common(tok, 64, 2, 4, 2, 128, 2048, False)).to_dict(),
                        vision_config=vision, scale_factor=2, image_token_id=tok.token_to_id("<image>"),
                        tie_word_embeddings=False)
    config.architectures = [architecture]
    torch.manual_seed(seed)
    model = (SmolVLMForConditionalGeneration if smol else Idefics3ForConditionalGeneration)(config).to(torch.float32)
    _spread_vision(model, ("vision_model", "connector"))
    _randomize_norms(model)
    _save(str(folder), model, tok, max_shard_size=None, generation=None)
    with open(os.path.join(folder, "tokenizer_config.json"), encoding="utf-8") as f:
        tok_config = json.load(f)
    tok_config["chat_template"] = LLAVA_CHAT_TEMPLATE.replace("<image>\n", "<image>")
    with open(os.path.join(folder, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(tok_config, f, indent=2)
    images = Idefics3ImageProcessorPil(size={"longest_edge": 72}, max_image_size={"longest_edge": 36},
                                       do_image_splitting=do_image_splitting, image_mean=[0.5, 0.5, 0.5],
                                       image_std=[0.5, 0.5, 0.5])
    images.save_pretrained(str(folder))  # preprocessor_config.json, as transformers < 5 saved it
    with tempfile.TemporaryDirectory() as tmp:  # processor_config.json, as transformers 5 writes it
        processor = Idefics3Processor(images, PreTrainedTokenizerFast.from_pretrained(str(folder)), image_seq_len=9)
        processor.save_pretrained(tmp)
        shutil.copy(os.path.join(tmp, "processor_config.json"), os.path.join(folder, "processor_config.json"))
    return str(folder)


PIXTRAL_TOKENS = ["[IMG]", "[IMG_BREAK]", "[IMG_END]"]


def make_tiny_mistral3(folder, *, tie_word_embeddings: bool = False, seed: int = 0,
                       text: dict[str, Any] | None = None) -> str:
    """A Mistral 3 checkpoint (Mistral3ForConditionalGeneration): a tiny Mistral (16-dim heads), a two-layer
    Pixtral tower of 4-pixel patches (SiLU, as the hub's), the projector merging 2x2 patches, the tokenizer's
    `[IMG]` / `[IMG_BREAK]` / `[IMG_END]` special tokens, PixtralImageProcessor's preprocessor_config.json
    (longest edge 64: at most 8x8 image rows), processor_config.json, and a chat template that writes `[IMG]`
    for image parts. text: text_config fields over the tiny Mistral's (a Ministral 3: tiny_ministral3.py)."""
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration

    return _make_tiny_pixtral_model(folder, Mistral3Config, Mistral3ForConditionalGeneration, merge=2,
                                    extra=dict(spatial_merge_size=2), tie_word_embeddings=tie_word_embeddings,
                                    seed=seed, text=text)


def make_tiny_llava_pixtral(folder, *, seed: int = 0) -> str:
    """Pixtral-12B's layout at tiny size: LlavaForConditionalGeneration over the two-layer Pixtral tower of
    make_tiny_mistral3 (no patch merging: one image row per 4-pixel patch, the "full" feature strategy), LLaVA's
    projector, PixtralProcessor's files with spatial_merge_size 1 (longest edge 32: at most 8x8 rows)."""
    from transformers import LlavaConfig, LlavaForConditionalGeneration

    return _make_tiny_pixtral_model(folder, LlavaConfig, LlavaForConditionalGeneration, merge=1,
                                    extra=dict(vision_feature_select_strategy="full", projector_hidden_act="gelu"),
                                    tie_word_embeddings=False, seed=seed)


def _make_tiny_pixtral_model(folder, config_cls, model_cls, *, merge: int, extra: dict, tie_word_embeddings: bool,
                             seed: int, text: dict[str, Any] | None = None) -> str:
    import torch
    from tokenizers import AddedToken

    tok = build_tokenizer()
    tok.add_tokens([AddedToken(t, special=True, normalized=False) for t in PIXTRAL_TOKENS])
    text = dict(model_type="mistral", vocab_size=tok.get_vocab_size(), hidden_size=64, intermediate_size=128,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                max_position_embeddings=2048, rms_norm_eps=1e-5, initializer_range=0.1, bos_token_id=1,
                eos_token_id=EOS_TOKEN_ID, pad_token_id=0, sliding_window=None,
                tie_word_embeddings=tie_word_embeddings) | (text or {})
    vision = dict(model_type="pixtral", hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                  num_attention_heads=2, head_dim=16, patch_size=4, image_size=64, hidden_act="silu")
    config = config_cls(text_config=text, vision_config=vision, image_token_index=tok.token_to_id("[IMG]"),
                        vision_feature_layer=-1, tie_word_embeddings=tie_word_embeddings, **extra)
    config.architectures = [model_cls.__name__]
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32)
    _spread_vision(model, ("vision_tower", "multi_modal_projector"), scale=lambda name, param: param.dim() == 1)
    _randomize_norms(model)
    _save(str(folder), model, tok, max_shard_size=None, generation=None)
    mean, std = [0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711]
    files = {
        "preprocessor_config.json": {"image_processor_type": "PixtralImageProcessor", "do_resize": True,
                                     "resample": 3, "size": {"longest_edge": 32 * merge}, "patch_size": 4,
                                     "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
                                     "image_mean": mean, "image_std": std, "do_convert_rgb": True},
        "processor_config.json": {"processor_class": "PixtralProcessor", "patch_size": 4, "spatial_merge_size": merge,
                                  "image_token": "[IMG]", "image_break_token": "[IMG_BREAK]",
                                  "image_end_token": "[IMG_END]"},
    }
    for name, data in files.items():
        with open(os.path.join(folder, name), "w", encoding="utf-8") as f:
            json.dump(data, f, indent=2)
    with open(os.path.join(folder, "tokenizer_config.json"), encoding="utf-8") as f:
        tok_config = json.load(f)
    tok_config["chat_template"] = LLAVA_CHAT_TEMPLATE.replace("<image>\n", "[IMG]")
    with open(os.path.join(folder, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(tok_config, f, indent=2)
    return str(folder)


LLAVA_NEXT_PINPOINTS = [[28, 56], [56, 28], [56, 56], [84, 28]]


def make_tiny_llava_next(folder, *, text: str = "llama", seed: int = 0) -> str:
    """A LLaVA-NeXT checkpoint (LlavaNextForConditionalGeneration): a tiny CLIP tower of 28-pixel tiles and
    7-pixel patches (4x4 rows a tile; feature layer -2, class token dropped), the projector, image_newline, and
    a Llama or Mistral (no sliding window) language model; `<image>` is the last token of the vocabulary;
    LlavaNextImageProcessor's preprocessor_config.json with small grid pinpoints (LLAVA_NEXT_PINPOINTS); the
    LLaVA chat template."""
    import torch
    from tokenizers import AddedToken
    from transformers import (
        CLIPVisionConfig,
        LlamaConfig,
        LlavaNextConfig,
        LlavaNextForConditionalGeneration,
        MistralConfig,
    )
    from transformers.models.llava_next.image_processing_pil_llava_next import LlavaNextImageProcessorPil

    tok = build_tokenizer()
    tok.add_tokens([AddedToken("<image>", special=True, normalized=False)])
    params = _common(tok, 64, 2, 4, 2, 128, 2048, False)
    text_config = LlamaConfig(**params) if text == "llama" else MistralConfig(**params, sliding_window=None)
    vision_config = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2,
                                     image_size=28, patch_size=7)
    config = LlavaNextConfig(vision_config=vision_config, text_config=text_config,
                             image_token_index=tok.token_to_id("<image>"), vision_feature_layer=-2,
                             vision_feature_select_strategy="default", projector_hidden_act="gelu",
                             image_grid_pinpoints=LLAVA_NEXT_PINPOINTS)
    config.architectures = ["LlavaNextForConditionalGeneration"]
    torch.manual_seed(seed)
    model = LlavaNextForConditionalGeneration(config).to(torch.float32)
    _spread_vision(model, ("vision_tower", "multi_modal_projector", "image_newline"), vector_std=0.5)
    _randomize_norms(model)
    _save(str(folder), model, tok, max_shard_size=None, generation=None)
    LlavaNextImageProcessorPil(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28},
                               image_grid_pinpoints=LLAVA_NEXT_PINPOINTS).save_pretrained(str(folder))
    with open(os.path.join(folder, "tokenizer_config.json"), encoding="utf-8") as f:
        tok_config = json.load(f)
    tok_config["chat_template"] = LLAVA_CHAT_TEMPLATE
    with open(os.path.join(folder, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(tok_config, f, indent=2)
    return str(folder)
