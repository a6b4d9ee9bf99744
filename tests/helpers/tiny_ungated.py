"""Tiny random Arcee (ReLU-squared MLP) and Apertus (xIELU MLP, q/k norms) checkpoints written by transformers (norms
and xIELU's learned parameters randomised)."""

from __future__ import annotations

from tests.helpers.tiny_models import _common, _randomize_norms, _save, build_tokenizer

_ROPE = {"rope_type": "default", "rope_theta": 10_000.0}


def make_tiny_arcee(folder, *, hidden_size: int = 64, num_layers: int = 2, num_heads: int = 4, num_kv_heads: int = 2,
                    intermediate_size: int = 96, seed: int = 0) -> str:
    import torch
    from transformers import ArceeConfig, ArceeForCausalLM

    tok = build_tokenizer()
    params = _common(tok, hidden_size, num_layers, num_heads, num_kv_heads, intermediate_size, 2048, False)
    config = ArceeConfig(**params, rope_parameters=dict(_ROPE))
    torch.manual_seed(seed)
    model = ArceeForCausalLM(config).to(torch.float32)
    _randomize_norms(model)
    return _save(str(folder), model, tok, max_shard_size=None, generation=None)


def make_tiny_apertus(folder, *, hidden_size: int = 64, num_layers: int = 2, num_heads: int = 4, num_kv_heads: int = 2,
                      intermediate_size: int = 96, seed: int = 0) -> str:
    import torch
    from transformers import ApertusConfig, ApertusForCausalLM

    tok = build_tokenizer()
    params = _common(tok, hidden_size, num_layers, num_heads, num_kv_heads, intermediate_size, 2048, False)
    config = ApertusConfig(**params, rope_parameters=dict(_ROPE))
    torch.manual_seed(seed)
    model = ApertusForCausalLM(config).to(torch.float32)
    _randomize_norms(model)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("act_fn.alpha_p", "act_fn.alpha_n")):
                param.uniform_(-0.5, 1.0)
    return _save(str(folder), model, tok, max_shard_size=None, generation=None)
