"""Tiny random GPT-NeoX (Pythia), GPT-2, OPT, Phi-2 and StarCoder2 checkpoints written by transformers (LayerNorm weights and biases, and every
projection bias randomised: transformers inits them at 1 and 0)."""

from __future__ import annotations

from tests.helpers.tiny_models import _common, _save, build_tokenizer


def _randomize(model, norm_marks: tuple[str, ...], sharpen_qk: bool = False) -> None:
    """LayerNorm weights in [0.5, 1.5] and biases ~ N(0, 0.1) (transformers inits them at 1 and 0), every other bias
    ~ N(0, 0.1); sharpen_qk: q/k projections times 8, so attention is sharp and positions decide the outputs."""
    import torch

    with torch.no_grad():
        for name, param in model.named_parameters():
            if any(mark in name for mark in norm_marks):
                param.uniform_(0.5, 1.5) if name.endswith("weight") else param.normal_(0.0, 0.1)
            elif name.endswith(".bias"):
                param.normal_(0.0, 0.1)
            if sharpen_qk and name.endswith(("q_proj.weight", "k_proj.weight")):
                param.mul_(8.0)


def make_tiny_gpt_neox(folder, *, hidden_size: int = 64, num_layers: int = 2, num_heads: int = 4,
                       intermediate_size: int = 128, rotary_pct: float = 0.25, parallel: bool = True,
                       hidden_act: str = "gelu", seed: int = 0) -> str:
    """Pythia's layout: parallel residual, a quarter of each 16-dim head rotating, exact GELU, untied embed_out."""
    import torch
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    tok = build_tokenizer()
    params = _common(tok, hidden_size, num_layers, num_heads, num_heads, intermediate_size, 2048, False)
    params.pop("rms_norm_eps", None)
    params.pop("num_key_value_heads", None)
    config = GPTNeoXConfig(**params, use_parallel_residual=parallel, hidden_act=hidden_act,
                           rope_parameters={"rope_type": "default", "rope_theta": 10_000.0,
                                            "partial_rotary_factor": rotary_pct})
    torch.manual_seed(seed)
    model = GPTNeoXForCausalLM(config).to(torch.float32)
    _randomize(model, ("layernorm", "layer_norm"))
    return _save(str(folder), model, tok, max_shard_size=None, generation=None)


def make_tiny_gpt2(folder, *, hidden_size: int = 64, num_layers: int = 2, num_heads: int = 4, n_positions: int = 256,
                   seed: int = 0) -> str:
    """GPT-2's layout (Conv1D weights, fused c_attn, learned positions, gelu_new, tied head), its config.json in GPT-2's
    own names (n_embd, n_layer...)."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    tok = build_tokenizer()
    config = GPT2Config(vocab_size=tok.get_vocab_size(), n_embd=hidden_size, n_layer=num_layers, n_head=num_heads,
                        n_positions=n_positions, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(seed)
    model = GPT2LMHeadModel(config).to(torch.float32)
    _randomize(model, (".ln_",))
    return _save(str(folder), model, tok, max_shard_size=None, generation=None)


def make_tiny_opt(folder, *, hidden_size: int = 64, num_layers: int = 2, num_heads: int = 4, ffn_dim: int = 128,
                  max_position_embeddings: int = 256, seed: int = 0) -> str:
    """OPT's layout (opt-125m's, shrunk): pre-LayerNorm layers, ReLU MLP (fc1 / fc2), positions offset by 2, tied."""
    import torch
    from transformers import OPTConfig, OPTForCausalLM

    tok = build_tokenizer()
    config = OPTConfig(vocab_size=tok.get_vocab_size(), hidden_size=hidden_size, num_hidden_layers=num_layers,
                       num_attention_heads=num_heads, ffn_dim=ffn_dim, word_embed_proj_dim=hidden_size,
                       max_position_embeddings=max_position_embeddings, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(seed)
    model = OPTForCausalLM(config).to(torch.float32)
    _randomize(model, ("layer_norm",))
    return _save(str(folder), model, tok, max_shard_size=None, generation=None)


def make_tiny_phi(folder, *, hidden_size: int = 64, num_layers: int = 2, num_heads: int = 4, intermediate_size: int = 128,
                  rope_theta: float = 100.0, seed: int = 0) -> str:
    """Phi-2's layout: one LayerNorm a layer feeding attention and MLP in parallel, 0.4 of each 16-dim head rotating
    (6 dims; rope theta 100 by default, so every pair turns within the prompts), gelu_new, an LM head with a bias."""
    import torch
    from transformers import PhiConfig, PhiForCausalLM

    tok = build_tokenizer()
    config = PhiConfig(vocab_size=tok.get_vocab_size(), hidden_size=hidden_size, num_hidden_layers=num_layers,
                       num_attention_heads=num_heads, intermediate_size=intermediate_size,
                       max_position_embeddings=2048, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                       rope_parameters={"rope_type": "default", "rope_theta": rope_theta, "partial_rotary_factor": 0.4})
    torch.manual_seed(seed)
    model = PhiForCausalLM(config).to(torch.float32)
    _randomize(model, ("layernorm",), sharpen_qk=True)
    return _save(str(folder), model, tok, max_shard_size=None, generation=None)


def make_tiny_starcoder2(folder, *, hidden_size: int = 64, num_layers: int = 2, num_heads: int = 4,
                         num_kv_heads: int = 2, intermediate_size: int = 128, sliding_window: int | None = 8,
                         seed: int = 0) -> str:
    """StarCoder2's layout: GQA, biased LayerNorms and projections, a GELU-tanh MLP, an 8-token sliding window (the
    prompts cross it), tied embeddings."""
    import torch
    from transformers import Starcoder2Config, Starcoder2ForCausalLM

    tok = build_tokenizer()
    config = Starcoder2Config(vocab_size=tok.get_vocab_size(), hidden_size=hidden_size, num_hidden_layers=num_layers,
                              num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
                              intermediate_size=intermediate_size, max_position_embeddings=2048,
                              sliding_window=sliding_window, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                              rope_parameters={"rope_type": "default", "rope_theta": 1000.0})
    torch.manual_seed(seed)
    model = Starcoder2ForCausalLM(config).to(torch.float32)
    _randomize(model, ("layernorm", "model.norm"), sharpen_qk=True)
    return _save(str(folder), model, tok, max_shard_size=None, generation=None)
