"""Tiny random GLM checkpoints written by transformers: GLM-4.5-style Glm4MoeForCausalLM (grouped sigmoid
routing with a correction bias, shared experts, dense first layers, q/k norms, partial rotary) and
GLM-4-0414-style Glm4ForCausalLM (sandwich norms, fused gate_up_proj, interleaved partial rotary).

Norms, q/k/v biases, the routers and the correction biases are randomised (transformers inits them at
1, 0, 0.02 and 0), so each of them decides something in the tokens compared."""

from __future__ import annotations

import os
from typing import Any

from tests.helpers.config_edit import edit_config
from tests.helpers.tiny_models import _common, _randomize_norms, _save, build_tokenizer


def _randomize(model, *, router_std: float) -> None:
    import torch

    _randomize_norms(model)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                param.normal_(0.0, router_std)
            elif name.endswith("_proj.bias"):
                param.normal_(0.0, 0.1)
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.normal_(0.0, 0.2)




def _add_mtp_layer(folder: str, num_layers: int) -> None:
    """GLM-4.5's multi-token-prediction layer after the last decoder layer (model.layers.{num_layers}:
    a copy of the last layer's tensors plus eh_proj / enorm / hnorm / shared_head), as the released
    checkpoints carry it; transformers' Glm4Moe does not run it."""
    from safetensors.torch import load_file, save_file

    path = os.path.join(folder, "model.safetensors")
    tensors = load_file(path)
    last, mtp = f"model.layers.{num_layers - 1}.", f"model.layers.{num_layers}."
    extra = {mtp + k[len(last):]: v.clone() for k, v in tensors.items() if k.startswith(last)}
    hidden = tensors["model.norm.weight"].shape[0]
    extra[mtp + "eh_proj.weight"] = tensors["model.norm.weight"].new_ones(hidden, 2 * hidden)
    for leaf in ("enorm.weight", "hnorm.weight", "shared_head.norm.weight"):
        extra[mtp + leaf] = tensors["model.norm.weight"].clone()
    save_file({**tensors, **extra}, path, metadata={"format": "pt"})


def make_tiny_glm4_moe(folder, *, hidden_size: int = 64, num_layers: int = 3, num_heads: int = 4,
                       num_kv_heads: int = 2, head_dim: int = 32, intermediate_size: int = 96,
                       n_routed_experts: int = 8, top_k: int = 3, moe_intermediate_size: int = 32,
                       n_shared_experts: int = 1, n_group: int = 4, topk_group: int = 2,
                       first_k_dense_replace: int = 1, routed_scaling_factor: float = 2.5,
                       norm_topk_prob: bool = True, use_qk_norm: bool = True, attention_bias: bool = True,
                       partial_rotary_factor: float | None = 0.5, mtp_layers: int = 1,
                       tie_word_embeddings: bool = False, seed: int = 0) -> str:
    """A GLM-4.5 (GLM-4.5-Air: use_qk_norm=False, n_group=1). partial_rotary_factor None: left out of
    config.json (transformers' default 0.5). mtp_layers: MTP layers' tensors appended after the last
    decoder layer, num_nextn_predict_layers set to match."""
    import torch
    from transformers import Glm4MoeConfig, Glm4MoeForCausalLM

    tok = build_tokenizer()
    params = _common(tok, hidden_size, num_layers, num_heads, num_kv_heads, intermediate_size, 2048,
                     tie_word_embeddings)
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": 10000.0}
    if partial_rotary_factor is not None:
        rope["partial_rotary_factor"] = partial_rotary_factor
    config = Glm4MoeConfig(**params, head_dim=head_dim, rope_parameters=rope, n_routed_experts=n_routed_experts,
                           num_experts_per_tok=top_k, moe_intermediate_size=moe_intermediate_size,
                           n_shared_experts=n_shared_experts, n_group=n_group, topk_group=topk_group,
                           first_k_dense_replace=first_k_dense_replace, routed_scaling_factor=routed_scaling_factor,
                           norm_topk_prob=norm_topk_prob, use_qk_norm=use_qk_norm, attention_bias=attention_bias,
                           num_nextn_predict_layers=mtp_layers)
    torch.manual_seed(seed)
    model = Glm4MoeForCausalLM(config).to(torch.float32)
    _randomize(model, router_std=0.5)
    folder = _save(str(folder), model, tok, max_shard_size=None, generation=None)
    if partial_rotary_factor is None:
        rope_saved = dict(config.rope_parameters)
        rope_saved.pop("partial_rotary_factor", None)
        edit_config(folder, rope_parameters=rope_saved, partial_rotary_factor=None)
    if mtp_layers:
        _add_mtp_layer(folder, num_layers)
    return folder


def make_tiny_glm(folder, *, hidden_size: int = 64, num_layers: int = 2, num_heads: int = 4, num_kv_heads: int = 2,
                  head_dim: int = 32, intermediate_size: int = 96, seed: int = 0) -> str:
    """A GLM-4-9B in transformers' Glm layout (glm-4-9b-chat-hf's shape, scaled down): pre-norm layers, q/k/v
    biases, fused gate_up_proj, half the head rotating interleaved."""
    import torch
    from transformers import GlmConfig, GlmForCausalLM

    tok = build_tokenizer()
    params = _common(tok, hidden_size, num_layers, num_heads, num_kv_heads, intermediate_size, 2048, False)
    config = GlmConfig(**params, head_dim=head_dim, attention_bias=True,
                       rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})
    torch.manual_seed(seed)
    model = GlmForCausalLM(config).to(torch.float32)
    _randomize(model, router_std=0.5)
    return _save(str(folder), model, tok, max_shard_size=None, generation=None)


def make_tiny_glm4(folder, *, hidden_size: int = 64, num_layers: int = 2, num_heads: int = 4, num_kv_heads: int = 2,
                   head_dim: int = 32, intermediate_size: int = 96, partial_rotary_factor: float | None = 0.5,
                   attention_bias: bool = True, tie_word_embeddings: bool = False, seed: int = 0) -> str:
    """A GLM-4-0414 (GLM-4-9B-0414's shape, scaled down). partial_rotary_factor None: left out of
    config.json (transformers' default 0.5)."""
    import torch
    from transformers import Glm4Config, Glm4ForCausalLM

    tok = build_tokenizer()
    params = _common(tok, hidden_size, num_layers, num_heads, num_kv_heads, intermediate_size, 2048,
                     tie_word_embeddings)
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": 10000.0}
    if partial_rotary_factor is not None:
        rope["partial_rotary_factor"] = partial_rotary_factor
    config = Glm4Config(**params, head_dim=head_dim, rope_parameters=rope, attention_bias=attention_bias)
    torch.manual_seed(seed)
    model = Glm4ForCausalLM(config).to(torch.float32)
    _randomize(model, router_std=0.5)
    folder = _save(str(folder), model, tok, max_shard_size=None, generation=None)
    if partial_rotary_factor is None:
        rope_saved = dict(config.rope_parameters)
        rope_saved.pop("partial_rotary_factor", None)
        edit_config(folder, rope_parameters=rope_saved, partial_rotary_factor=None)
    return folder
