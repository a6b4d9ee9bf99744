"""A tiny random InternVL checkpoint in transformers' own layout (InternVLForConditionalGeneration, the hub's
InternVL3 / InternVL3.5 "-hf" repos), with the tokenizer, processor files and chat template its
InternVLProcessor loads from."""

from __future__ import annotations

import json
import os
from typing import Any

from tests.helpers.tiny_models import _common, _randomize_norms, _save, _spread_vision, build_tokenizer

# The tokens InternVLProcessor reads off the tokenizer (its extra_special_tokens), as the hub's tokenizers
# name them.
INTERNVL_TOKENS = {"start_image_token": "<img>", "end_image_token": "</img>",
                   "context_image_token": "<IMG_CONTEXT>", "video_token": "<video>"}
# The hub's -hf chat templates write `<IMG_CONTEXT>\n` for an image part.
INTERNVL_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'image' %}<IMG_CONTEXT>\n"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TILE = 56  # pixels a tile side: 8x8 patches of 7, pixel shuffled to 4x4 = 16 rows a tile
TOKENS_PER_TILE = 16


def make_tiny_internvl(folder, *, text: str = "qwen2", seed: int = 0) -> str:
    """text: "qwen2" (InternVL3's language model; a LayerNorm InternViT with q/k/v bias, as InternViT-300M) or
    "qwen3" (InternVL3.5's; an RMSNorm InternViT with q/k norms, as InternViT-6B). The vision tower: 56-pixel
    tiles of 7-pixel patches, 32 wide, 2 layers; GotOcr2ImageProcessor's preprocessor_config.json with at most
    4 tiles an image (plus the thumbnail), InternVLProcessor's processor_config.json (16 tokens a tile)."""
    import torch
    from tokenizers import AddedToken
    from transformers import (
        GotOcr2ImageProcessorPil,
        InternVLConfig,
        InternVLForConditionalGeneration,
        Qwen2Config,
        Qwen3Config,
    )

    tok = build_tokenizer()
    tok.add_tokens([AddedToken(t, special=True, normalized=False) for t in INTERNVL_TOKENS.values()])
    common = _common(tok, 64, 2, 4, 2, 128, 2048, False)
    text_config: Any = (Qwen2Config(**common) if text == "qwen2"
                        else Qwen3Config(**common, head_dim=16))
    rms = text == "qwen3"
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=TILE,
                  patch_size=7, norm_type="rms_norm" if rms else "layer_norm", use_qk_norm=rms,
                  attention_bias=not rms, layer_scale_init_value=1.0)
    config = InternVLConfig(text_config=text_config.to_dict(), vision_config=vision,
                            image_token_id=tok.token_to_id("<IMG_CONTEXT>"), image_seq_length=TOKENS_PER_TILE,
                            downsample_ratio=0.5, tie_word_embeddings=False)
    config.architectures = ["InternVLForConditionalGeneration"]
    torch.manual_seed(seed)
    model = InternVLForConditionalGeneration(config).to(torch.float32)
    # Layer scales (lambda_1/2) and the projector's LayerNorm drawn around 1 too, so they are tested.
    _spread_vision(model, ("vision_tower", "multi_modal_projector"),
                   scale=lambda name, param: param.dim() == 1 and ("norm" in name or "lambda" in name)
                   and name.endswith(("weight", "lambda_1", "lambda_2")))
    _randomize_norms(model)
    with torch.no_grad():  # image rows about as large as token embeddings, so neither drowns the other
        for param in model.model.multi_modal_projector.linear_2.parameters():
            param.mul_(0.05)
    _save(str(folder), model, tok, max_shard_size=None, generation=None)
    with open(os.path.join(folder, "tokenizer_config.json"), encoding="utf-8") as f:
        tok_config = json.load(f)
    tok_config["chat_template"] = INTERNVL_CHAT_TEMPLATE
    tok_config["extra_special_tokens"] = dict(INTERNVL_TOKENS)
    with open(os.path.join(folder, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(tok_config, f, indent=2)
    images = GotOcr2ImageProcessorPil(size={"height": TILE, "width": TILE}, crop_to_patches=True, min_patches=1,
                                      max_patches=4)
    images.save_pretrained(str(folder))  # preprocessor_config.json
    # The hub's processor_config.json (transformers cannot build InternVLProcessor without torchvision, which
    # its video processor needs: tests build it with no_video_processor below).
    with open(os.path.join(folder, "processor_config.json"), "w", encoding="utf-8") as f:
        json.dump({"processor_class": "InternVLProcessor", "image_seq_length": TOKENS_PER_TILE}, f, indent=2)
    return str(folder)


def internvl_processor(folder) -> Any:
    """transformers' InternVLProcessor of a tiny folder, built without a video processor (its class needs
    torchvision, which the test environment lacks; images never reach it)."""
    from transformers import GotOcr2ImageProcessorPil, InternVLProcessor, PreTrainedTokenizerFast

    class ImagesOnly(InternVLProcessor):
        def check_argument_for_proper_class(self, argument_name, argument):
            if argument_name == "video_processor" and argument is None:
                return None
            return super().check_argument_for_proper_class(argument_name, argument)

    with open(os.path.join(folder, "processor_config.json"), encoding="utf-8") as f:
        seq = json.load(f)["image_seq_length"]
    return ImagesOnly(GotOcr2ImageProcessorPil.from_pretrained(str(folder)),
                      PreTrainedTokenizerFast.from_pretrained(str(folder)), None, image_seq_length=seq)


# The hub's InternVL2.5 / InternVL3 chat template takes string content (ferrox's chat rendering gives
# "<image>\n" per image part, as vLLM's does).
INTERNVL_CHAT_TEMPLATE_STRING = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# The native names (transformers 5's save) -> the remote code's, per layer; q/k/v are fused below.
_REMOTE_LAYER = {"attention.projection_layer.": "attn.proj.", "attention.q_norm.": "attn.q_norm.",
                 "attention.k_norm.": "attn.k_norm.", "layernorm_before.": "norm1.", "layernorm_after.": "norm2.",
                 "mlp.": "mlp.", "lambda_1": "ls1", "lambda_2": "ls2"}
_REMOTE_TOP = {"vision_tower.embeddings.cls_token": "vision_model.embeddings.class_embedding",
               "vision_tower.embeddings.position_embeddings": "vision_model.embeddings.position_embedding",
               "vision_tower.embeddings.patch_embeddings.projection.": "vision_model.embeddings.patch_embedding.",
               "multi_modal_projector.layer_norm.": "mlp1.0.", "multi_modal_projector.linear_1.": "mlp1.1.",
               "multi_modal_projector.linear_2.": "mlp1.3.", "language_model.": "language_model."}


def _remote_name(name: str) -> str:
    for old, new in _REMOTE_TOP.items():
        if name.startswith(old):
            return new + name[len(old):]
    prefix = "vision_tower.encoder.layer."
    number, _, rest = name.removeprefix(prefix).partition(".")
    for old, new in _REMOTE_LAYER.items():
        if name.startswith(prefix) and rest.startswith(old):
            return f"vision_model.encoder.layers.{number}.{new}{rest[len(old):]}"
    raise AssertionError(f"no remote name for {name}")


def make_tiny_internvl_chat(folder, *, text: str = "qwen2", seed: int = 0, max_dynamic_patch: int = 6,
                            **config_fields: Any) -> tuple[str, str]:
    """(native folder, remote folder): make_tiny_internvl's checkpoint, and the same weights written by hand in
    InternVL's remote-code layout (InternVLChatModel) as the hub's OpenGVLab repos publish it: q/k/v fused
    into attn.qkv, the remote names, config.json with llm_config and an InternVisionConfig vision_config, the
    string-content chat template, no preprocessor_config.json. config_fields: top-level fields to override."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    native = make_tiny_internvl(os.path.join(str(folder), "native"), text=text, seed=seed)
    remote = os.path.join(str(folder), "remote")
    os.makedirs(remote)
    tensors = load_file(os.path.join(native, "model.safetensors"))
    out = {}
    for name, tensor in tensors.items():
        part = next((p for p in ("q_proj", "k_proj", "v_proj") if f".attention.{p}." in name), None)
        if part is None:
            out[_remote_name(name)] = tensor
        elif part == "q_proj":
            layer, _, kind = name.partition(".attention.q_proj.")
            fused = torch.cat([tensors[f"{layer}.attention.{p}.{kind}"] for p in ("q_proj", "k_proj", "v_proj")])
            number = layer.rsplit(".", 1)[1]
            out[f"vision_model.encoder.layers.{number}.attn.qkv.{kind}"] = fused
    save_file(out, os.path.join(remote, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(native, "config.json"), encoding="utf-8") as f:
        hf = json.load(f)
    vision, llm = hf["vision_config"], dict(hf["text_config"])
    rms = vision["norm_type"] == "rms_norm"
    llm["architectures"] = ["Qwen3ForCausalLM" if text == "qwen3" else "Qwen2ForCausalLM"]
    config = {
        "architectures": ["InternVLChatModel"], "model_type": "internvl_chat", "torch_dtype": "bfloat16",
        "auto_map": {"AutoConfig": "configuration_internvl_chat.InternVLChatConfig",
                     "AutoModel": "modeling_internvl_chat.InternVLChatModel"},
        "downsample_ratio": 0.5, "dynamic_image_size": True, "force_image_size": TILE,
        "max_dynamic_patch": max_dynamic_patch, "min_dynamic_patch": 1, "ps_version": "v2", "select_layer": -1,
        "template": "internvl2_5", "use_backbone_lora": 0, "use_llm_lora": 0, "use_thumbnail": True,
        "llm_config": llm,
        "vision_config": {
            "architectures": ["InternVisionModel"], "model_type": "intern_vit_6b", "hidden_size": vision["hidden_size"],
            "intermediate_size": vision["intermediate_size"], "num_attention_heads": vision["num_attention_heads"],
            "num_hidden_layers": vision["num_hidden_layers"], "image_size": TILE, "patch_size": 7, "num_channels": 3,
            "qkv_bias": not rms, "qk_normalization": rms, "norm_type": vision["norm_type"],
            "layer_norm_eps": vision["layer_norm_eps"], "hidden_act": "gelu", "initializer_factor": 1.0,
            "initializer_range": 0.02, "drop_path_rate": 0.0, "dropout": 0.0, "attention_dropout": 0.0,
            "use_flash_attn": False},
        **config_fields,
    }
    with open(os.path.join(remote, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
    for name in ("tokenizer.json", "generation_config.json"):
        shutil.copy(os.path.join(native, name), remote)
    with open(os.path.join(native, "tokenizer_config.json"), encoding="utf-8") as f:
        tok_config = json.load(f)
    tok_config.pop("extra_special_tokens", None)
    tok_config["chat_template"] = INTERNVL_CHAT_TEMPLATE_STRING
    with open(os.path.join(remote, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(tok_config, f, indent=2)
    return native, remote

