"""Tiny random Hunyuan dense checkpoints written by transformers (norms randomised: transformers inits them at 1)."""

from __future__ import annotations

from tests.helpers.tiny_models import _common, _randomize_norms, _save, build_tokenizer


def make_tiny_hunyuan(folder, *, hidden_size: int = 64, num_layers: int = 2, num_heads: int = 4, num_kv_heads: int = 2,
                      intermediate_size: int = 96, alpha: float | None = 1000.0, seed: int = 0) -> str:
    """Hunyuan-7B's layout: q/k normed per head after rotary; alpha: its NTK-alpha rope scaling ({"rope_type":
    "dynamic", "alpha": ...}), None: plain rotary."""
    import torch
    from transformers import HunYuanDenseV1Config, HunYuanDenseV1ForCausalLM

    tok = build_tokenizer()
    params = _common(tok, hidden_size, num_layers, num_heads, num_kv_heads, intermediate_size, 2048, False)
    rope = {"rope_type": "default", "rope_theta": 10_000.0}
    if alpha is not None:
        rope = {"rope_type": "dynamic", "rope_theta": 10_000.0, "alpha": alpha, "factor": 1.0}
    config = HunYuanDenseV1Config(**params, head_dim=hidden_size // num_heads, rope_parameters=rope)
    torch.manual_seed(seed)
    model = HunYuanDenseV1ForCausalLM(config).to(torch.float32)
    _randomize_norms(model)
    return _save(str(folder), model, tok, max_shard_size=None, generation=None)


def make_tiny_hunyuan_moe(folder, *, hidden_size: int = 64, num_layers: int = 2, num_heads: int = 4,
                          num_kv_heads: int = 2, intermediate_size: int = 32, num_experts: int = 8, top_k: int = 2,
                          seed: int = 0) -> str:
    """Hunyuan-A13B's layout, shrunk: every layer routed (8 experts, top 2) beside the shared MLP, q/k normed after
    rotary, NTK-alpha; the router randomised (its float32 weights) so the choices differ by token."""
    import torch
    from transformers import HunYuanMoEV1Config, HunYuanMoEV1ForCausalLM

    tok = build_tokenizer()
    params = _common(tok, hidden_size, num_layers, num_heads, num_kv_heads, intermediate_size, 2048, False)
    config = HunYuanMoEV1Config(**params, head_dim=hidden_size // num_heads, num_experts=num_experts, moe_topk=top_k,
                                rope_parameters={"rope_type": "dynamic", "rope_theta": 10_000.0, "alpha": 1000.0,
                                                 "factor": 1.0})
    torch.manual_seed(seed)
    model = HunYuanMoEV1ForCausalLM(config).to(torch.float32)
    _randomize_norms(model)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("gate.wg.weight"):
                param.normal_(0.0, 0.5)
    return _save(str(folder), model, tok, max_shard_size=None, generation=None)
