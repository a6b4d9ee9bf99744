"""Tiny random Cohere (Command R, R+, Aya) and Cohere2 (Command R7B / Command A) checkpoints written by transformers
(norm weights randomised: transformers inits them at 1)."""

from __future__ import annotations

from tests.helpers.tiny_models import _common, _randomize_norms, _save, build_tokenizer


def make_tiny_cohere2(folder, *, hidden_size: int = 64, num_layers: int = 4, num_heads: int = 4, num_kv_heads: int = 2,
                      intermediate_size: int = 96, sliding_window: int = 8, logit_scale: float = 0.25,
                      seed: int = 0) -> str:
    """Command R7B's layout: layers 0-2 windowed (8 tokens, so the prompts cross it) with interleaved rotary, layer 3
    global without rotary; tied embeddings; logits times logit_scale."""
    import torch
    from transformers import Cohere2Config, Cohere2ForCausalLM

    tok = build_tokenizer()
    params = _common(tok, hidden_size, num_layers, num_heads, num_kv_heads, intermediate_size, 2048, True)
    params.pop("rms_norm_eps", None)
    config = Cohere2Config(**params, sliding_window=sliding_window, logit_scale=logit_scale, layer_norm_eps=1e-5,
                           rope_parameters={"rope_type": "default", "rope_theta": 50_000.0})
    torch.manual_seed(seed)
    model = Cohere2ForCausalLM(config).to(torch.float32)
    _randomize_norms(model)
    return _save(str(folder), model, tok, max_shard_size=None, generation=None)


def make_tiny_cohere(folder, *, hidden_size: int = 64, num_layers: int = 3, num_heads: int = 4, num_kv_heads: int = 2,
                     intermediate_size: int = 96, use_qk_norm: bool = False, logit_scale: float = 0.125,
                     seed: int = 0) -> str:
    """Command R / Aya (every layer rotating, interleaved); use_qk_norm: Command R+'s per-head q/k LayerNorms (their
    [heads, head_dim] weights randomised too)."""
    import torch
    from transformers import CohereConfig, CohereForCausalLM

    tok = build_tokenizer()
    params = _common(tok, hidden_size, num_layers, num_heads, num_kv_heads, intermediate_size, 2048, True)
    params.pop("rms_norm_eps", None)
    config = CohereConfig(**params, use_qk_norm=use_qk_norm, logit_scale=logit_scale, layer_norm_eps=1e-5,
                          rope_parameters={"rope_type": "default", "rope_theta": 8_000.0})
    torch.manual_seed(seed)
    model = CohereForCausalLM(config).to(torch.float32)
    _randomize_norms(model)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                param.uniform_(0.5, 1.5)
    return _save(str(folder), model, tok, max_shard_size=None, generation=None)
