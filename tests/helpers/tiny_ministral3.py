"""Tiny random Ministral 3 checkpoints written by transformers: Ministral3ForCausalLM (text only, as Devstral 2
and the params.json conversions are), Mistral3ForConditionalGeneration over a `ministral3` text config (the
Ministral 3 releases' layout), and the FP8 releases' layout of either (transformers 5's per-tensor FP8 names).

The rope is YaRN over a tiny original context (ORIGINAL = 16 positions, factor 8: 128 served), so 40-70 token
prompts cross several multiples of it: the YaRN frequencies and, through floor(p / 16), Llama 4's query scaling
(a large beta) both change the tokens within a short prompt. Norms are randomised (transformers inits them at 1).
"""

from __future__ import annotations

import json
import os
from typing import Any

from tests.helpers.tiny_models import _common, _randomize_norms, _save, build_tokenizer, make_tiny_mistral3

ORIGINAL = 16
# The text-only conversions' rope (mscale_all_dim 0: cos and sin scaled by 0.1 ln(factor) + 1), with a ramp
# between extrapolated and interpolated pairs inside a 16-dim head (beta_fast 4, beta_slow 0.5).
ROPE: dict[str, Any] = {"rope_type": "yarn", "type": "yarn", "rope_theta": 10000.0, "factor": 8.0,
                        "original_max_position_embeddings": ORIGINAL, "beta_fast": 4.0, "beta_slow": 0.5,
                        "mscale": 1.0, "mscale_all_dim": 0.0, "llama_4_scaling_beta": 0.5}
# The multimodal releases' (mscale = mscale_all_dim = 1: no cos / sin scaling).
MULTIMODAL_ROPE = {**ROPE, "mscale_all_dim": 1.0, "llama_4_scaling_beta": 0.3}
# Ministral 3's FP8 releases' quantization_config (transformers' convert_mistral3_weights_to_hf).
FP8_CONFIG = {"activation_scheme": "static", "dequantize": False, "quant_method": "fp8", "weight_block_size": None,
              "modules_to_not_convert": ["model.vision_tower", "model.multi_modal_projector", "lm_head"]}


def text_fields(**overrides: Any) -> dict[str, Any]:
    """The tiny language model's config fields (head_dim 16, GQA 4/2, 128 positions)."""
    return {"model_type": "ministral3", "head_dim": 16, "max_position_embeddings": ORIGINAL * 8,
            "rope_parameters": dict(ROPE), "sliding_window": None, **overrides}


def make_tiny_ministral3(folder, *, tie_word_embeddings: bool = False, seed: int = 0, **overrides: Any) -> str:
    """A Ministral3ForCausalLM (2 layers, hidden 64; overrides: config fields, e.g. sliding_window)."""
    import torch
    from transformers import Ministral3Config, Ministral3ForCausalLM

    tok = build_tokenizer()
    params = _common(tok, 64, 2, 4, 2, 128, ORIGINAL * 8, tie_word_embeddings)
    fields = text_fields(**overrides)
    fields.pop("model_type")
    config = Ministral3Config(**{**params, **fields})
    torch.manual_seed(seed)
    model = Ministral3ForCausalLM(config).to(torch.float32)
    _randomize_norms(model)
    return _save(str(folder), model, tok, max_shard_size=None, generation=None)


def make_tiny_ministral3_multimodal(folder, *, seed: int = 0) -> str:
    """make_tiny_mistral3's Mistral3ForConditionalGeneration (Pixtral tower, projector, processor files) over a
    ministral3 text config with the multimodal releases' rope and a tied LM head (the 3B's)."""
    return make_tiny_mistral3(folder, tie_word_embeddings=True, seed=seed,
                              text=text_fields(rope_parameters=dict(MULTIMODAL_ROPE)))


def write_fp8_release(folder: str, dst, tensors: dict[str, Any]) -> str:
    """A copy of float checkpoint `folder` at `dst` in the FP8 releases' layout: `tensors` as its weights (their
    scales named as transformers 5 saves them: `weight_scale_inv`, `activation_scale`) and FP8_CONFIG at
    config.json's top level (beside text_config for a multimodal one)."""
    import shutil

    from safetensors.torch import save_file

    dst = str(dst)
    os.makedirs(dst)
    for name in os.listdir(folder):
        if not name.endswith(".safetensors"):
            shutil.copy(os.path.join(folder, name), dst)
    with open(os.path.join(dst, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    config["quantization_config"] = dict(FP8_CONFIG)
    with open(os.path.join(dst, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
    # (cloned: a tied lm_head shares the embedding's storage, which safetensors refuses)
    save_file({k: v.detach().clone().contiguous() for k, v in tensors.items()}, os.path.join(dst, "model.safetensors"))
    return dst
