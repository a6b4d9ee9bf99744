"""Tiny random gpt-oss checkpoints: one written by transformers' save_pretrained (the experts' fused
bf16 layout: gate_up_proj [E, H, 2I] interleaved, down_proj [E, I, H]) and the same weights in the
published MXFP4 layout (`*_blocks` / `*_scales`, quantization_config quant_method "mxfp4").

The expert matrices are first rounded onto the MXFP4 grid (quantized and dequantized here), so both
folders describe exactly the same model and transformers, which loads the first, is the reference
for both. Biases, sinks and norms are drawn at random (transformers inits some at zero or one), the
sinks wide enough to take a real share of each softmax, and swiglu_limit is low enough that the
clamps bite.
"""

from __future__ import annotations

import json
import os
from typing import Any

from tests.helpers.tiny_models import _common, _randomize_norms, _save, build_tokenizer

WINDOW = 8  # the sliding window of the even layers: prompts run well past it
ROPE = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "original_max_position_embeddings": 64,
        "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False}


def make_tiny_gpt_oss(folder, *, hidden_size: int = 64, num_layers: int = 3, num_heads: int = 4,
                      num_kv_heads: int = 2, head_dim: int = 16, num_experts: int = 8, top_k: int = 4,
                      intermediate_size: int = 32, seed: int = 0, **config_fields: Any) -> str:
    """A gpt-oss in transformers' layout (layer_types: sliding, full, sliding...). Sizes are multiples
    of 32 where MXFP4 groups them (hidden_size, intermediate_size)."""
    import torch
    from ferrox.layers.quant.mxfp4 import dequantize_mxfp4, quantize_mxfp4
    from transformers import GptOssConfig, GptOssForCausalLM

    tok = build_tokenizer()
    # max_position_embeddings: YaRN's original context x factor, as transformers expects it.
    params = _common(tok, hidden_size, num_layers, num_heads, num_kv_heads, intermediate_size, 256, False)
    fields = dict(head_dim=head_dim, num_local_experts=num_experts, num_experts_per_tok=top_k,
                  sliding_window=WINDOW, rope_parameters=dict(ROPE), swiglu_limit=1.0, swiglu_alpha=1.5,
                  attention_bias=True)
    config = GptOssConfig(**params, **(fields | config_fields))
    torch.manual_seed(seed)
    model = GptOssForCausalLM(config).to(torch.float32).eval()
    _randomize_norms(model)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_(0.0, 1.5)
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj,
                         layer.self_attn.o_proj):
                proj.bias.normal_(0.0, 0.1)
            layer.mlp.router.weight.normal_(0.0, 0.5)
            experts = layer.mlp.experts
            experts.gate_up_proj_bias.normal_(0.0, 0.2)
            experts.down_proj_bias.normal_(0.0, 0.1)
            for name in ("gate_up_proj", "down_proj"):  # onto the MXFP4 grid: [E, in, out] -> rows of outputs
                weight = getattr(experts, name)
                blocks, scales = quantize_mxfp4(weight.transpose(1, 2))
                weight.copy_(dequantize_mxfp4(blocks, scales, torch.float32).transpose(1, 2))
    return _save(str(folder), model, tok, max_shard_size=None, generation=None)


def write_mxfp4_copy(src: str, dst: str) -> str:
    """The checkpoint at `src` (make_tiny_gpt_oss) with its expert matrices in MXFP4 blocks and scales, as
    the published gpt-oss checkpoints store them, and their quantization_config."""
    import shutil

    import torch
    from ferrox.layers.quant.mxfp4 import quantize_mxfp4
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    os.remove(os.path.join(dst, "model.safetensors"))
    tensors = load_file(os.path.join(src, "model.safetensors"))
    out: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            blocks, scales = quantize_mxfp4(tensor.transpose(1, 2))  # [E, out, in / 32, 16], [E, out, in / 32]
            out[f"{name}_blocks"], out[f"{name}_scales"] = blocks, scales
        else:
            out[name] = tensor
    save_file(out, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    path = os.path.join(dst, "config.json")
    with open(path, encoding="utf-8") as f:
        config = json.load(f)
    config["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
                                   "lm_head"],
    }
    with open(path, "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
    return dst
