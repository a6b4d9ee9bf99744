"""Tiny random Mistral 4 checkpoints written by transformers: Mistral4ForCausalLM (3 layers, the first dense) and
Mistral3ForConditionalGeneration over a `mistral4` text config (the Mistral Small 4 releases' layout: the Pixtral
tower of tiny_models.make_tiny_mistral3).

Latent attention as tiny_deepseek's (kv_lora_rank 32, rope 16 + nope 16 dims a query head, v 24, q LoRA 48),
6 routed experts in 3 groups (topk_group 1: the group of the best pair of scores) plus a shared one,
top 2, renormalised and scaled. The rope is YaRN over a 16-position original context (factor 8: 128 served,
mscale_all_dim 0.8 so the softmax scale moves too) with Llama 4's query scaling at a large beta, so 40-70 token
prompts cross several multiples of it. Transformers saves the experts stacked (`experts.gate_up_proj` [E, 2I, H],
`experts.down_proj` [E, H, I]), as the releases store them. Routers keep transformers' init (initializer_range 0.1:
logits of std ~1, so the best expert and the best pair of a group often differ, and ties stay far below float
rounding); norms are random.
"""

from __future__ import annotations

from typing import Any

from tests.helpers.tiny_models import _common, _randomize_norms, _save, build_tokenizer, make_tiny_mistral3

ORIGINAL = 16
ROPE: dict[str, Any] = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0,
                        "original_max_position_embeddings": ORIGINAL, "beta_fast": 4.0, "beta_slow": 0.5,
                        "mscale": 1.0, "mscale_all_dim": 0.8, "llama_4_scaling_beta": 0.5,
                        "partial_rotary_factor": 0.5}


def text_fields(**overrides: Any) -> dict[str, Any]:
    """The tiny language model's Mistral4Config fields (beside _common's sizes)."""
    return {"model_type": "mistral4", "q_lora_rank": 48, "kv_lora_rank": 32, "qk_rope_head_dim": 16,
            "qk_nope_head_dim": 16, "v_head_dim": 24, "n_routed_experts": 6, "n_shared_experts": 1,
            "num_experts_per_tok": 2, "moe_intermediate_size": 24, "first_k_dense_replace": 1, "n_group": 3,
            "topk_group": 1, "routed_scaling_factor": 1.5, "norm_topk_prob": True, "rope_interleave": True,
            "max_position_embeddings": ORIGINAL * 8, "rope_parameters": dict(ROPE), **overrides}


def make_tiny_mistral4(folder, *, seed: int = 0, **overrides: Any) -> str:
    """A Mistral4ForCausalLM (hidden 64, 4 heads, 3 layers; overrides: config fields)."""
    import torch
    from transformers import Mistral4Config, Mistral4ForCausalLM

    tok = build_tokenizer()
    fields = text_fields(**overrides)
    fields.pop("model_type")
    config = Mistral4Config(**{**_common(tok, 64, 3, 4, 4, 96, ORIGINAL * 8, False), **fields})
    config.architectures = ["Mistral4ForCausalLM"]
    torch.manual_seed(seed)
    model = Mistral4ForCausalLM(config).to(torch.float32)
    _randomize_norms(model)
    return _save(str(folder), model, tok, max_shard_size=None, generation=None)


def make_tiny_mistral4_multimodal(folder, *, seed: int = 0) -> str:
    """make_tiny_mistral3's Mistral3ForConditionalGeneration (Pixtral tower, projector, processor files) over the
    tiny mistral4 text config, 2 layers (the first dense); head_dim qk_nope + qk_rope (transformers' rotary reads
    it, times partial_rotary_factor)."""
    text = text_fields(num_hidden_layers=2, intermediate_size=96, num_key_value_heads=4, head_dim=32)
    return make_tiny_mistral3(folder, seed=seed, text=text)
