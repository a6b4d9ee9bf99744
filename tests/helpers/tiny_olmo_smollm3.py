"""Tiny random SmolLM3, OLMo 2, OLMo 3 and OLMoE checkpoints written by transformers.

Norms (the full-width q/k norms included), routers and biases are randomised (transformers inits them at
1, 0.02 and 0), so each of them decides something in the tokens compared."""

from __future__ import annotations

from typing import Any

from tests.helpers.tiny_models import _common, _moe_model, _randomize_norms, _save, build_tokenizer

_ROPE = {"rope_type": "default", "rope_theta": 10000.0}


def _randomize_biases(model) -> None:
    import torch

    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("_proj.bias"):
                param.normal_(0.0, 0.1)


def make_tiny_smollm3(folder, *, hidden_size: int = 64, num_layers: int = 4, num_heads: int = 4,
                      num_kv_heads: int = 2, intermediate_size: int = 96, no_rope_layers: list[int] | None = None,
                      no_rope_layer_interval: int = 4, use_sliding_window: bool = False,
                      sliding_window: int | None = None, attention_bias: bool = False,
                      tie_word_embeddings: bool = True, seed: int = 0) -> str:
    """A SmolLM3: no_rope_layers None lets transformers derive it (every no_rope_layer_interval-th layer
    NoPE); its config.json then lists it, as the hub's does."""
    import torch
    from transformers import SmolLM3Config, SmolLM3ForCausalLM

    tok = build_tokenizer()
    params = _common(tok, hidden_size, num_layers, num_heads, num_kv_heads, intermediate_size, 2048,
                     tie_word_embeddings)
    extra: dict[str, Any] = {}
    if no_rope_layers is not None:
        extra["no_rope_layers"] = no_rope_layers
    config = SmolLM3Config(**params, **extra, rope_parameters=dict(_ROPE), no_rope_layer_interval=no_rope_layer_interval,
                           use_sliding_window=use_sliding_window, sliding_window=sliding_window,
                           attention_bias=attention_bias)
    torch.manual_seed(seed)
    model = SmolLM3ForCausalLM(config).to(torch.float32)
    _randomize_norms(model)
    _randomize_biases(model)
    return _save(str(folder), model, tok, max_shard_size=None, generation=None)


def make_tiny_olmo2(folder, *, hidden_size: int = 64, num_layers: int = 2, num_heads: int = 4, num_kv_heads: int = 2,
                    intermediate_size: int = 96, attention_bias: bool = False, tie_word_embeddings: bool = False,
                    seed: int = 0) -> str:
    """An OLMo 2 (post-norms, full-width q/k norms; GQA 4/2 so the k norm is narrower than the q norm)."""
    import torch
    from transformers import Olmo2Config, Olmo2ForCausalLM

    tok = build_tokenizer()
    params = _common(tok, hidden_size, num_layers, num_heads, num_kv_heads, intermediate_size, 2048,
                     tie_word_embeddings)
    config = Olmo2Config(**params, rope_parameters=dict(_ROPE), attention_bias=attention_bias)
    torch.manual_seed(seed)
    model = Olmo2ForCausalLM(config).to(torch.float32)
    _randomize_norms(model)
    _randomize_biases(model)
    return _save(str(folder), model, tok, max_shard_size=None, generation=None)


def make_tiny_olmo3(folder, *, hidden_size: int = 64, num_layers: int = 4, num_heads: int = 4, num_kv_heads: int = 2,
                    intermediate_size: int = 96, sliding_window: int = 8, yarn_factor: float | None = 4.0,
                    seed: int = 0) -> str:
    """An OLMo 3: OLMo 2's layers, layers 0-2 sliding (an 8-token window, so the prompts cross it), layer 3 full;
    YaRN on the full layer only (transformers' rope_parameters keyed by layer type, as its config.json writes)."""
    import torch
    from transformers import Olmo3Config, Olmo3ForCausalLM

    tok = build_tokenizer()
    params = _common(tok, hidden_size, num_layers, num_heads, num_kv_heads, intermediate_size, 2048, False)
    full = {"rope_type": "default", "rope_theta": 50_000.0}
    if yarn_factor is not None:
        full = {"rope_type": "yarn", "rope_theta": 50_000.0, "factor": yarn_factor,
                "original_max_position_embeddings": 512}
    config = Olmo3Config(**params, sliding_window=sliding_window,
                         rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 50_000.0},
                                          "full_attention": full})
    torch.manual_seed(seed)
    model = Olmo3ForCausalLM(config).to(torch.float32)
    _randomize_norms(model)
    return _save(str(folder), model, tok, max_shard_size=None, generation=None)


def make_tiny_olmoe(folder, *, hidden_size: int = 64, num_layers: int = 2, num_heads: int = 4, num_kv_heads: int = 2,
                    num_experts: int = 8, top_k: int = 2, intermediate_size: int = 32, norm_topk_prob: bool = False,
                    clip_qkv: float | None = None, seed: int = 0) -> str:
    """An OLMoE (pre-norm MoE layers, full-width q/k norms, softmax top-k; clip_qkv clamps q/k/v)."""
    from transformers import OlmoeConfig, OlmoeForCausalLM

    tok = build_tokenizer()
    params = _common(tok, hidden_size, num_layers, num_heads, num_kv_heads, intermediate_size, 2048, False)
    model = _moe_model(OlmoeConfig, OlmoeForCausalLM, tok, seed, router_std=0.5, **params, num_experts=num_experts,
                       num_experts_per_tok=top_k, norm_topk_prob=norm_topk_prob, clip_qkv=clip_qkv)
    return _save(str(folder), model, tok, max_shard_size=None, generation=None)
