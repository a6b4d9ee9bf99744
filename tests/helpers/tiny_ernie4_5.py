"""Tiny random ERNIE 4.5 checkpoints written by transformers (norms and biases randomised: transformers inits them at
1 and 0, so each decides something in the tokens compared)."""

from __future__ import annotations

from tests.helpers.tiny_models import _common, _randomize_norms, _save, build_tokenizer


def _randomize_biases(model) -> None:
    import torch

    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("_proj.bias"):
                param.normal_(0.0, 0.1)


def make_tiny_ernie4_5(folder, *, hidden_size: int = 64, num_layers: int = 2, num_heads: int = 4,
                       num_kv_heads: int = 2, intermediate_size: int = 96, use_bias: bool = True,
                       tie_word_embeddings: bool = True, seed: int = 0) -> str:
    """The 0.3B's layout: biases on every projection, tied embeddings, interleaved rotary (theta 500,000)."""
    import torch
    from transformers import Ernie4_5Config, Ernie4_5ForCausalLM

    tok = build_tokenizer()
    params = _common(tok, hidden_size, num_layers, num_heads, num_kv_heads, intermediate_size, 2048,
                     tie_word_embeddings)
    config = Ernie4_5Config(**params, use_bias=use_bias, rope_parameters={"rope_type": "default",
                                                                          "rope_theta": 500_000.0})
    torch.manual_seed(seed)
    model = Ernie4_5ForCausalLM(config).to(torch.float32)
    _randomize_norms(model)
    _randomize_biases(model)
    return _save(str(folder), model, tok, max_shard_size=None, generation=None)


def make_tiny_ernie4_5_moe(folder, *, hidden_size: int = 64, num_layers: int = 4, num_heads: int = 4,
                           num_kv_heads: int = 2, intermediate_size: int = 96, num_experts: int = 8, top_k: int = 2,
                           moe_intermediate_size: int = 32, num_shared: int = 1, start: int = 1, end: int = -1,
                           interval: int = 1, use_bias: bool = False, seed: int = 0) -> str:
    """The 21B-A3B's layout, shrunk: layer 0 dense, the rest sparse (8 experts, top 2, one shared), tied
    embeddings; the router and its balancing bias randomised so that the bias moves choices."""
    import torch
    from transformers import Ernie4_5_MoeConfig, Ernie4_5_MoeForCausalLM

    tok = build_tokenizer()
    params = _common(tok, hidden_size, num_layers, num_heads, num_kv_heads, intermediate_size, 2048, True)
    config = Ernie4_5_MoeConfig(**params, use_bias=use_bias, moe_intermediate_size=moe_intermediate_size,
                                moe_k=top_k, moe_num_experts=num_experts, moe_num_shared_experts=num_shared,
                                moe_layer_start_index=start, moe_layer_end_index=end, moe_layer_interval=interval,
                                rope_parameters={"rope_type": "default", "rope_theta": 500_000.0})
    torch.manual_seed(seed)
    model = Ernie4_5_MoeForCausalLM(config).to(torch.float32)
    _randomize_norms(model)
    _randomize_biases(model)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                param.normal_(0.0, 0.5)
            elif name.endswith("e_score_correction_bias"):
                param.uniform_(0.0, 0.3)
    return _save(str(folder), model, tok, max_shard_size=None, generation=None)
