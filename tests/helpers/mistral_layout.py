"""A Hugging Face checkpoint folder rewritten in Mistral's native layout (params.json + consolidated.safetensors),
for tests/models/test_mistral_format.py: the inverse of transformers' convert_mistral_weights_to_hf.py /
convert_mistral3_weights_to_hf.py, written here independently of the loader's mapping.

Names: model.layers.N.self_attn.q_proj.weight -> layers.N.attention.wq.weight and so on; q/k rows (text and
vision) put back in Mistral's rotary order (each head's rotary pairs side by side: HF keeps the first halves of
the pairs, then the second halves); an FP8 projection's weight_scale / input_scale -> qscale_weight / qscale_act.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any

import torch

_TEXT = {"self_attn.q_proj": "attention.wq", "self_attn.k_proj": "attention.wk", "self_attn.v_proj": "attention.wv",
         "self_attn.o_proj": "attention.wo", "mlp.gate_proj": "feed_forward.w1", "mlp.down_proj": "feed_forward.w2",
         "mlp.up_proj": "feed_forward.w3", "input_layernorm": "attention_norm",
         "post_attention_layernorm": "ffn_norm"}
_VISION = {"attention.q_proj": "attention.wq", "attention.k_proj": "attention.wk", "attention.v_proj": "attention.wv",
           "attention.o_proj": "attention.wo", "feed_forward.gate_proj": "feed_forward.w1",
           "feed_forward.down_proj": "feed_forward.w2", "feed_forward.up_proj": "feed_forward.w3"}
_LEAVES = {"weight_scale": "qscale_weight", "input_scale": "qscale_act"}
_PROJECTOR = {"multi_modal_projector.linear_1": "vision_language_adapter.w_in",
              "multi_modal_projector.linear_2": "vision_language_adapter.w_out",
              "multi_modal_projector.norm": "pre_mm_projector_norm",
              "multi_modal_projector.patch_merger": "patch_merger"}
_RENAMES = (("model.language_model.", "model."), ("language_model.model.", "model."),
            ("language_model.lm_head.", "lm_head."), ("model.vision_tower.", "vision_tower."),
            ("model.multi_modal_projector.", "multi_modal_projector."))


def to_mistral_rows(w: torch.Tensor, heads: int) -> torch.Tensor:
    """HF rotary rows -> Mistral's (the inverse of transformers' permute_for_rope), moving float8 as bytes."""
    raw = w.view(torch.uint8) if w.dtype == torch.float8_e4m3fn else w
    rows = raw.shape[0]
    out = raw.reshape(heads, 2, rows // heads // 2, *raw.shape[1:]).transpose(1, 2).reshape(raw.shape)
    return out.view(w.dtype) if w.dtype == torch.float8_e4m3fn else out


def native_name(name: str) -> str:
    for old, new in _RENAMES:
        if name.startswith(old):
            name = new + name[len(old):]
            break
    top = {"model.embed_tokens.weight": "tok_embeddings.weight", "model.norm.weight": "norm.weight",
           "lm_head.weight": "output.weight"}
    if name in top:
        return top[name]
    for old, new in _PROJECTOR.items():
        if name.startswith(old + "."):
            return new + name[len(old):]
    if name.startswith("vision_tower."):
        rest = name[len("vision_tower."):]
        for old, new in _VISION.items():
            rest = rest.replace(f".{old}.", f".{new}.")
        return "vision_encoder." + rest
    assert name.startswith("model.layers."), name
    layer, _, rest = name[len("model.layers."):].partition(".")
    module, _, leaf = rest.rpartition(".")
    return f"layers.{layer}.{_TEXT[module]}.{_LEAVES.get(leaf, leaf)}"


def native_tensors(tensors: dict[str, torch.Tensor], config: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The HF-named `tensors` under Mistral's names, q/k rows (and per-row scales) in Mistral's order."""
    text = config.get("text_config") or config
    vision = config.get("vision_config") or {}
    out = {}
    for name, w in tensors.items():
        new = native_name(name)
        if w.numel() > 1 and (".wq." in new or ".wk." in new):
            heads = vision["num_attention_heads"] if new.startswith("vision_encoder.") else (
                text["num_attention_heads"] if ".wq." in new else text["num_key_value_heads"])
            w = to_mistral_rows(w, heads)
        out[new] = w.contiguous()
    return out


def params_of(config: dict[str, Any]) -> dict[str, Any]:
    """params.json of a Mistral / Llama config.json (the text model; vision added by the caller)."""
    text = config.get("text_config") or config
    rope = text.get("rope_parameters") or {}
    params = {"dim": text["hidden_size"], "n_layers": text["num_hidden_layers"], "n_heads": text["num_attention_heads"],
              "n_kv_heads": text["num_key_value_heads"],
              "head_dim": text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"],
              "hidden_dim": text["intermediate_size"], "norm_eps": text["rms_norm_eps"],
              "vocab_size": text["vocab_size"], "rope_theta": rope.get("rope_theta", text.get("rope_theta", 10000.0)),
              "max_seq_len": text["max_position_embeddings"],
              "tied_embeddings": bool(config.get("tie_word_embeddings", text.get("tie_word_embeddings", False)))}
    if text.get("sliding_window"):
        params["sliding_window"] = text["sliding_window"]
    return params


def write_mistral_folder(hf_folder: str, dst, *, params: dict[str, Any] | None = None,
                         tensors: dict[str, torch.Tensor] | None = None, keep_config: bool = False) -> str:
    """`hf_folder` (or `tensors` under its config) rewritten at `dst`: params.json (params_of its config, updated
    with `params`), consolidated.safetensors, and its tokenizer files; config.json and the HF weights only with
    keep_config."""
    from safetensors.torch import load_file, save_file

    dst = str(dst)
    os.makedirs(dst, exist_ok=True)
    with open(os.path.join(hf_folder, "config.json")) as f:
        config = json.load(f)
    for name in os.listdir(hf_folder):
        hf_file = name == "config.json" or name.endswith(".safetensors") or name.endswith(".index.json")
        if keep_config or not hf_file:
            shutil.copy(os.path.join(hf_folder, name), dst)
    if tensors is None:
        tensors = load_file(os.path.join(hf_folder, "model.safetensors"))
    save_file(native_tensors(tensors, config), os.path.join(dst, "consolidated.safetensors"))
    with open(os.path.join(dst, "params.json"), "w") as f:
        json.dump({**params_of(config), **(params or {})}, f)
    return dst
