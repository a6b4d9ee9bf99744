"""Tiny random DeepSeek-V2 / V3 checkpoints written by transformers (tiny_models' tokenizer and layout).

Each has multi-head latent attention (kv_lora_rank 32, rope 16 + nope 16 dims a query head, v 24), one
dense layer first (first_k_dense_replace 1), then mixture-of-experts layers with shared experts. Routers
are drawn wider than transformers' init, and V3's e_score_correction_bias at random, so expert choices
are far from ties and the bias matters.
"""

from __future__ import annotations

from typing import Any

from tests.helpers.tiny_models import _common, _randomize_norms, _save, build_tokenizer

# YaRN as DeepSeek configures it (mscale and mscale_all_dim; V2-Lite's 0.707 both), over a 64-token
# original context: the softmax scale gains mscale(factor, mscale_all_dim) ** 2.
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 32,
        "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707}


def make_tiny_deepseek(folder, *, version: int = 3, q_lora_rank: int | None = 48, num_layers: int = 3,
                       num_experts: int = 6, top_k: int = 2, n_group: int = 1, topk_group: int = 1,
                       rope_scaling: dict[str, Any] | None = None, seed: int = 0, v_head_dim: int = 24,
                       moe_intermediate_size: int = 32, intermediate_size: int = 96, qk_nope_head_dim: int = 16,
                       qk_rope_head_dim: int = 16, kv_lora_rank: int = 32, **fields: Any) -> str:
    """A DeepseekV2ForCausalLM (version 2) or DeepseekV3ForCausalLM; q_lora_rank None: V2-Lite's q_proj.
    v_head_dim / moe_intermediate_size / intermediate_size: sizes a tensor-parallel block-FP8 test widens so
    that every rank's share falls on whole blocks; the head dims and kv_lora_rank: V2 / V3's real 128 / 64 /
    128 for FlashAttention-3's expanded prefill (kernels/mla_prefill.py). fields: more config fields (topk_method,
    routed_scaling_factor, rope_interleave, norm_topk_prob...)."""
    import torch
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM, DeepseekV3Config, DeepseekV3ForCausalLM

    config_cls, model_cls = ((DeepseekV2Config, DeepseekV2ForCausalLM) if version == 2
                             else (DeepseekV3Config, DeepseekV3ForCausalLM))
    tok = build_tokenizer()
    max_pos = 256 if rope_scaling else 2048
    params = _common(tok, 64, num_layers, 4, 4, intermediate_size, max_pos, False)
    rope = {"rope_type": "default", "rope_theta": 10000.0, **(rope_scaling or {})}
    config = config_cls(**params, rope_parameters=rope, q_lora_rank=q_lora_rank, kv_lora_rank=kv_lora_rank,
                        qk_rope_head_dim=qk_rope_head_dim, qk_nope_head_dim=qk_nope_head_dim, v_head_dim=v_head_dim,
                        n_routed_experts=num_experts, n_shared_experts=2, num_experts_per_tok=top_k,
                        moe_intermediate_size=moe_intermediate_size,
                        first_k_dense_replace=1, n_group=n_group, topk_group=topk_group, **fields)
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32)
    _randomize_norms(model)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                param.normal_(0.0, 0.5)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.normal_(0.0, 0.2)
    return _save(str(folder), model, tok, max_shard_size=None, generation=None)


def load_on_triton_kernels(folder: str, model_cls: Any, device: Any) -> Any:
    """A tiny DeepSeek folder as a float32 model built with kernels="triton" (the MLA kernels, Triton norms,
    rotary and fused MoE), weights loaded and finalized: what the kernel tests drive with tests.helpers.driver."""
    import torch
    from ferrox.loader.model_loader import load_model_spec
    from ferrox.loader.source import resolve_model
    from ferrox.loader.weights import iter_safetensors

    model = model_cls(load_model_spec(resolve_model(folder)), torch.float32, device, kernels="triton")
    model.load_weights(iter_safetensors(folder))
    model.finalize_weights()
    return model.eval()
