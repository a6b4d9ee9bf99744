"""A tiny random Qwen3-VL (Qwen3VLForConditionalGeneration, dense) in a temp folder, as transformers saves it,
and its mixture-of-experts sibling (Qwen3VLMoeForConditionalGeneration).

Sized so every Qwen3-VL-only piece decides tokens: three text layers with q/k norms and the interleaved
multimodal rotary (mrope_section [4, 2, 2] over 8 pairs: the interleave and the tail the temporal row keeps
both matter), a three-block vision tower of 16-pixel patches whose learned position table (4 x 4) is
interpolated to each image's grid, and DeepStack from blocks 0 and 1 into text layers 0 and 1.
"""

from __future__ import annotations

import json
import os
from typing import Any

from tests.helpers.tiny_models import (
    EOS_TOKEN_ID,
    LLAVA_CHAT_TEMPLATE,
    QWEN_VL_TOKENS,
    _randomize_norms,
    _save,
    _spread_vision,
    build_tokenizer,
)

PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"
VIDEO_PAD = "<|video_pad|>"
VIDEO_PLACEHOLDER = "<|vision_start|><|video_pad|><|vision_end|>"


def _text_and_vision(tok, text_layers: int, deepstack: tuple[int, ...]) -> tuple[dict[str, Any], dict[str, Any]]:
    text = dict(vocab_size=tok.get_vocab_size(), hidden_size=64, intermediate_size=128, num_hidden_layers=text_layers,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=2048,
                rms_norm_eps=1e-6, initializer_range=0.1, bos_token_id=1, eos_token_id=EOS_TOKEN_ID, pad_token_id=0,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 2, 2],
                                 "mrope_interleaved": True})
    vision: dict[str, Any] = dict(depth=3, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64,
                                  patch_size=16, spatial_merge_size=2, temporal_patch_size=2,
                                  num_position_embeddings=16, deepstack_visual_indexes=list(deepstack),
                                  hidden_act="gelu_pytorch_tanh")
    return text, vision


def _tokenizer(video: bool = False):
    from tokenizers import AddedToken

    tok = build_tokenizer()
    tok.add_tokens([AddedToken(t, special=True, normalized=False) for t in QWEN_VL_TOKENS + [VIDEO_PAD] * video])
    return tok


def make_tiny_qwen3_vl(folder, seed: int = 0, *, text_layers: int = 3, deepstack: tuple[int, ...] = (0, 1),
                       video: bool = False) -> str:
    """video: `<|video_pad|>` in the tokenizer and config.json, a video_preprocessor_config.json (the hub's
    Qwen3-VL layout, small bounds: a few merged squares a frame) and a chat template that writes the video
    placeholder for a video part."""
    import torch
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    tok = _tokenizer(video)
    start, end, pad = (tok.token_to_id(t) for t in QWEN_VL_TOKENS)
    text, vision = _text_and_vision(tok, text_layers, deepstack)
    ids = {"video_token_id": tok.token_to_id(VIDEO_PAD)} if video else {}
    config: Any = Qwen3VLConfig(text_config=text, vision_config=vision, image_token_id=pad,
                                vision_start_token_id=start, vision_end_token_id=end, tie_word_embeddings=False, **ids)
    config.architectures = ["Qwen3VLForConditionalGeneration"]
    torch.manual_seed(seed)
    model = Qwen3VLForConditionalGeneration(config).to(torch.float32)
    _spread_vision(model, ("visual",), scale=lambda name, param: param.dim() == 1 and name.endswith("weight"))
    _randomize_norms(model)
    return _write(folder, model, tok, video)


def make_tiny_qwen3_vl_moe(folder, seed: int = 0, *, video: bool = False) -> str:
    """Qwen3-VL-MoE: the same tower and rotary; text layers 0 and 2 sparse (6 experts of 16, top 2: 2 x 16 and
    16 both differ from hidden 64, so fused expert tensors tell their orientation by shape), layer 1 dense
    (mlp_only_layers). transformers 5.25 saves the experts fused as it holds them, gate_up_proj [E, 2 x I, hidden]
    and down_proj [E, hidden, I]; the hub's files hold the transposes (hub_expert_layout writes those)."""
    import torch
    from transformers import Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration

    tok = _tokenizer(video)
    start, end, pad = (tok.token_to_id(t) for t in QWEN_VL_TOKENS)
    text, vision = _text_and_vision(tok, 3, (0, 1))
    ids = {"video_token_id": tok.token_to_id(VIDEO_PAD)} if video else {}
    text.update(intermediate_size=96, moe_intermediate_size=16, num_experts=6, num_experts_per_tok=2,
                decoder_sparse_step=1, mlp_only_layers=[1])
    config: Any = Qwen3VLMoeConfig(text_config=text, vision_config=vision, image_token_id=pad,
                                   vision_start_token_id=start, vision_end_token_id=end, tie_word_embeddings=False,
                                   **ids)
    config.architectures = ["Qwen3VLMoeForConditionalGeneration"]
    torch.manual_seed(seed)
    model = Qwen3VLMoeForConditionalGeneration(config).to(torch.float32)
    _spread_vision(model, ("visual",), scale=lambda name, param: param.dim() == 1 and name.endswith("weight"))
    _randomize_norms(model)
    with torch.no_grad():  # a wide router: top-2 choices far from ties, so float noise decides no token
        for name, param in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                param.normal_(0.0, 0.5)
    return _write(folder, model, tok, video)


def _write(folder, model, tok, video: bool = False) -> str:
    _save(str(folder), model, tok, max_shard_size=None, generation=None)
    # Qwen3-VL's hub preprocessor_config.json layout (size in pixels, CLIP-free 0.5 mean and std), small bounds:
    # a few merged 32-pixel squares an image.
    processor = {"image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen3VLProcessor",
                 "do_resize": True, "resample": 3, "do_rescale": True, "rescale_factor": 1 / 255,
                 "do_normalize": True, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
                 "do_convert_rgb": True, "size": {"shortest_edge": 32 * 32 * 2, "longest_edge": 32 * 32 * 16},
                 "patch_size": 16, "temporal_patch_size": 2, "merge_size": 2}
    with open(os.path.join(folder, "preprocessor_config.json"), "w", encoding="utf-8") as f:
        json.dump(processor, f, indent=2)
    with open(os.path.join(folder, "tokenizer_config.json"), encoding="utf-8") as f:
        tok_config = json.load(f)
    tok_config["chat_template"] = LLAVA_CHAT_TEMPLATE.replace("<image>\n", PLACEHOLDER)
    if video:
        fields = {"video_processor_type": "Qwen3VLVideoProcessor", "processor_class": "Qwen3VLProcessor",
                  "size": {"shortest_edge": 32 * 32 * 4, "longest_edge": 32 * 32 * 24}, "patch_size": 16,
                  "temporal_patch_size": 2, "merge_size": 2, "image_mean": [0.5, 0.5, 0.5],
                  "image_std": [0.5, 0.5, 0.5], "fps": 2, "min_frames": 4, "max_frames": 768}
        with open(os.path.join(folder, "video_preprocessor_config.json"), "w", encoding="utf-8") as f:
            json.dump(fields, f, indent=2)
        tok_config["chat_template"] = tok_config["chat_template"].replace(
            "{% elif part['type'] == 'text' %}", "{% elif part['type'] == 'video' %}" + VIDEO_PLACEHOLDER
            + "{% elif part['type'] == 'text' %}")
    with open(os.path.join(folder, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(tok_config, f, indent=2)
    return str(folder)


def hub_expert_layout(folder, out) -> str:
    """A copy of a make_tiny_qwen3_vl_moe folder with the fused experts as the hub's Qwen3-VL-MoE files store them:
    gate_up_proj [E, hidden, 2 x I] and down_proj [E, I, hidden] (transformers transposes them on load)."""
    import shutil

    from safetensors.torch import load_file, save_file

    os.makedirs(out, exist_ok=True)
    for name in os.listdir(folder):
        if name != "model.safetensors":
            shutil.copy(os.path.join(folder, name), os.path.join(out, name))
    tensors = load_file(os.path.join(folder, "model.safetensors"))
    hub = {k: v.transpose(1, 2).contiguous() if k.endswith(("experts.gate_up_proj", "experts.down_proj")) else v
           for k, v in tensors.items()}
    save_file(hub, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    return str(out)
