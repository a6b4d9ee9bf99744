"""Tiny random Qwen2-VL / Qwen2.5-VL checkpoints that take videos: make_tiny_qwen2_vl's model with
`<|video_pad|>` in the tokenizer (and config.json's video_token_id), a video_preprocessor_config.json of
small min/max pixels (videos of a few merged patches a frame), and a chat template that writes the video
placeholder for video parts."""

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

VIDEO_PAD = "<|video_pad|>"
IMAGE_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"
VIDEO_PLACEHOLDER = "<|vision_start|><|video_pad|><|vision_end|>"
_CLIP = {"image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711]}


def make_tiny_qwen2_vl_video(folder, *, version: str = "qwen2_vl", seed: int = 0,
                             tokens_per_second: int = 2) -> str:
    import torch
    from tokenizers import AddedToken
    from transformers import (
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
        Qwen2VLConfig,
        Qwen2VLForConditionalGeneration,
    )

    tok = build_tokenizer()
    tok.add_tokens([AddedToken(t, special=True, normalized=False) for t in [*QWEN_VL_TOKENS, VIDEO_PAD]])
    start, end, pad, video = (tok.token_to_id(t) for t in [*QWEN_VL_TOKENS, VIDEO_PAD])
    text = dict(vocab_size=tok.get_vocab_size(), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048, rms_norm_eps=1e-6,
                initializer_range=0.1, bos_token_id=1, eos_token_id=EOS_TOKEN_ID, pad_token_id=0,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]})
    ids = dict(image_token_id=pad, video_token_id=video, vision_start_token_id=start, vision_end_token_id=end)
    if version == "qwen2_vl":
        vision: dict[str, Any] = dict(depth=2, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2, patch_size=14,
                                      spatial_merge_size=2, temporal_patch_size=2)
        config: Any = Qwen2VLConfig(text_config=text, vision_config=vision, **ids)
        config.architectures = ["Qwen2VLForConditionalGeneration"]
        model_cls: Any = Qwen2VLForConditionalGeneration
    else:
        vision = dict(depth=2, hidden_size=32, out_hidden_size=64, intermediate_size=48, num_heads=2, patch_size=14,
                      spatial_merge_size=2, temporal_patch_size=2, window_size=56, fullatt_block_indexes=[1],
                      tokens_per_second=tokens_per_second)
        config = Qwen2_5_VLConfig(text_config=text, vision_config=vision, **ids)
        config.architectures = ["Qwen2_5_VLForConditionalGeneration"]
        model_cls = Qwen2_5_VLForConditionalGeneration
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32)
    _spread_vision(model, ("visual",), scale=lambda name, param: param.dim() == 1 and name.endswith("weight"))
    _randomize_norms(model)
    folder = str(folder)
    _save(folder, model, tok, max_shard_size=None, generation=None)
    common = {"do_resize": True, "resample": 3, "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
              **_CLIP, "do_convert_rgb": True, "patch_size": 14, "temporal_patch_size": 2, "merge_size": 2}
    files = {"preprocessor_config.json": {"image_processor_type": "Qwen2VLImageProcessor", **common,
                                          "min_pixels": 56 * 56, "max_pixels": 28 * 28 * 16},
             # a video's own bounds, unlike the images' (as the hub's Qwen2.5-VL / transformers 5 folders have)
             "video_preprocessor_config.json": {"video_processor_type": "Qwen2VLVideoProcessor", **common,
                                                "size": {"shortest_edge": 28 * 28 * 2, "longest_edge": 28 * 28 * 6}}}
    for name, fields in files.items():
        with open(os.path.join(folder, name), "w", encoding="utf-8") as f:
            json.dump(fields, f, indent=2)
    with open(os.path.join(folder, "tokenizer_config.json"), encoding="utf-8") as f:
        tok_config = json.load(f)
    tok_config["chat_template"] = LLAVA_CHAT_TEMPLATE.replace("<image>\n", IMAGE_PLACEHOLDER).replace(
        "{% elif part['type'] == 'text' %}", "{% elif part['type'] == 'video' %}" + VIDEO_PLACEHOLDER
        + "{% elif part['type'] == 'text' %}")
    with open(os.path.join(folder, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(tok_config, f, indent=2)
    return folder


def write_video(path: str, frames: Any, fps: int = 4, codec: str = "libvpx-vp9") -> str:
    """An encoded video of `frames` (uint8 [T, H, W, 3]) at `path`, written with PyAV (lossless VP9, so
    the decoded frames are close to the written ones)."""
    import av

    with av.open(path, "w") as container:
        stream = container.add_stream(codec, rate=fps)
        stream.width, stream.height = frames.shape[2], frames.shape[1]
        stream.pix_fmt = "yuv420p"
        for frame in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path
