"""Tiny random Llama 4 checkpoints written by transformers: Llama4ForCausalLM, and
Llama4ForConditionalGeneration (a text model under `language_model.` beside a tiny vision tower, served
text-only).

Chunked local attention with a small attention_chunk_size (16), so 40-90 token prompts cross chunks; NoPE
layers mixed in (no_rope_layers: 1 rotates); MoE every interleave_moe_layer_step layers; a low floor_scale so
the NoPE layers' attention temperature changes within a short prompt; llama3 rope scaling. Norms and the
router are randomised (transformers inits them at 1 and 0.1), so each decides something in the tokens."""

from __future__ import annotations

from typing import Any

from tests.helpers.tiny_models import _common, _randomize_norms, _save, build_tokenizer

CHUNK = 16
# Scout's rope: llama3 scaling of theta 500,000 (the original context cut to fit a tiny model's positions).
ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64}


def text_config_fields(tok, *, hidden_size: int = 64, num_layers: int = 4, num_heads: int = 4, num_kv_heads: int = 2,
                       head_dim: int = 16, interleave_moe_layer_step: int = 1, num_experts: int = 4, top_k: int = 1,
                       intermediate_size: int = 32, intermediate_size_mlp: int = 96,
                       no_rope_layers: list[int] | None = None, attention_chunk_size: int | None = CHUNK,
                       use_qk_norm: bool = True, attn_temperature_tuning: bool = True, floor_scale: int = 8,
                       attn_scale: float = 0.5, rope: dict[str, Any] | None = None,
                       tie_word_embeddings: bool = False) -> dict[str, Any]:
    params = _common(tok, hidden_size, num_layers, num_heads, num_kv_heads, intermediate_size, 2048,
                     tie_word_embeddings)
    return dict(params, head_dim=head_dim, intermediate_size_mlp=intermediate_size_mlp,
                interleave_moe_layer_step=interleave_moe_layer_step, num_local_experts=num_experts,
                num_experts_per_tok=top_k, no_rope_layers=no_rope_layers or [1, 1, 0, 1][:num_layers],
                attention_chunk_size=attention_chunk_size, use_qk_norm=use_qk_norm,
                attn_temperature_tuning=attn_temperature_tuning, floor_scale=floor_scale, attn_scale=attn_scale,
                rope_parameters=dict(rope or ROPE))


def _randomize(model) -> None:
    import torch

    _randomize_norms(model)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("router.weight"):  # clear winners: top-1 far from ties
                param.normal_(0.0, 0.5)


def make_tiny_llama4(folder, *, seed: int = 0, **fields: Any) -> str:
    """A Llama4ForCausalLM (text_config_fields names the knobs; default: 4 layers, layer 2 NoPE, every
    layer MoE with 4 experts, top-1)."""
    import torch
    from transformers import Llama4ForCausalLM, Llama4TextConfig

    tok = build_tokenizer()
    config = Llama4TextConfig(**text_config_fields(tok, **fields))
    torch.manual_seed(seed)
    model = Llama4ForCausalLM(config)  # (float32; .to() would cast its complex rotary buffer)
    _randomize(model)
    return _save(str(folder), model, tok, max_shard_size=None, generation=None)


def make_tiny_llama4_multimodal(folder, *, seed: int = 0, **fields: Any) -> str:
    """A Llama4ForConditionalGeneration: the text model as make_tiny_llama4 builds it (weights under
    language_model.), a two-layer vision tower and projector ferrox does not build."""
    import torch
    from transformers import Llama4Config, Llama4ForConditionalGeneration

    tok = build_tokenizer()
    text = text_config_fields(tok, **fields)
    vision = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, image_size=28,
                  patch_size=14, vision_output_dim=32, projector_input_dim=32, projector_output_dim=32,
                  pixel_shuffle_ratio=0.5, rope_theta=10000)
    config = Llama4Config(text_config=text, vision_config=vision, image_token_index=tok.get_vocab_size() - 1,
                          boi_token_index=tok.get_vocab_size() - 2, eoi_token_index=tok.get_vocab_size() - 3)
    torch.manual_seed(seed)
    model = Llama4ForConditionalGeneration(config)
    _randomize(model)
    return _save(str(folder), model, tok, max_shard_size=None, generation=None)
