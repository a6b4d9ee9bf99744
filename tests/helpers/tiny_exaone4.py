"""Tiny random EXAONE 4.0 checkpoints written by transformers (norms randomised: transformers inits them at 1)."""

from __future__ import annotations

from tests.helpers.tiny_models import _common, _randomize_norms, _save, build_tokenizer


def make_tiny_exaone4(folder, *, hidden_size: int = 64, num_layers: int = 4, num_heads: int = 4, num_kv_heads: int = 2,
                      intermediate_size: int = 96, sliding_window: int | None = 8, sliding_window_pattern: int = 4,
                      tie_word_embeddings: bool = False, seed: int = 0) -> str:
    """sliding_window set: layers 0-2 windowed and rotating, layer 3 global without rotary (the 32B's layout);
    None: every layer full attention and rotating (the 1.2B's)."""
    import torch
    from transformers import Exaone4Config, Exaone4ForCausalLM

    tok = build_tokenizer()
    params = _common(tok, hidden_size, num_layers, num_heads, num_kv_heads, intermediate_size, 2048,
                     tie_word_embeddings)
    extra = {} if sliding_window is None else {"sliding_window_pattern": sliding_window_pattern}
    if sliding_window is None:
        extra["layer_types"] = ["full_attention"] * num_layers
    config = Exaone4Config(**params, sliding_window=sliding_window,
                           rope_parameters={"rope_type": "default", "rope_theta": 10_000.0}, **extra)
    torch.manual_seed(seed)
    model = Exaone4ForCausalLM(config).to(torch.float32)
    _randomize_norms(model)
    return _save(str(folder), model, tok, max_shard_size=None, generation=None)
