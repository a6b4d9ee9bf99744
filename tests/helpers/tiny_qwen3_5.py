"""Tiny random hybrid linear-attention Qwens in a temp folder, as transformers saves them: Qwen3.5
(Qwen3_5ForCausalLM, qwen3_5_text), Qwen3.5-MoE (Qwen3_5MoeForCausalLM, qwen3_5_moe_text), Qwen3-Next
(Qwen3NextForCausalLM, qwen3_next), and the Qwen3.5 multimodal checkpoints (Qwen3_5ForConditionalGeneration,
Qwen3_5MoeForConditionalGeneration: the text model under `model.language_model.`, Qwen3-VL's tower without
DeepStack under `model.visual.`, and tiny_qwen3_vl's processor files).

Shapes: hidden 64, four layers (three Gated DeltaNet, then one gated full attention: layer_types
LAYER_TYPES, full_attention_interval 4's pattern), attention 4 / 2 heads of 16 with a partial rotary of 8
dims (partial_rotary_factor 0.5; interleaved mrope_section [2, 1, 1] over those 4 pairs, as the releases'
[11, 11, 10] is over 32), linear attention 2 key heads of 16 and 4 value heads of 8 (2 value heads a key
head), a 4-tap causal conv. MoE: 8 experts of 32, top 2, a 32-wide shared expert behind a sigmoid gate.

Randomised so that nothing is trivial: the zero-centred RMSNorms (output * (1 + w), transformers inits w at
0) drawn in [-0.5, 0.5], the gated RMSNorm of the linear attention (output * w * silu(z), init 1) and other
`norm.weight`s in [0.5, 1.5] (_randomize_norms), A_log = log(A) for A in [0.05, 1] (transformers' A in
[0.01, 16] forgets the recurrent state within a token or two: exp(g) ~ e^-10), dt_bias in [-1, 1] (init 1),
the conv1d taps N(0, 0.5) (init N(0, 0.1): SiLU near-linear), routers N(0, 0.5) as tiny_models._moe_model's.
"""

from __future__ import annotations

import json
import os
from typing import Any

from tests.helpers.tiny_models import (
    QWEN_VL_TOKENS,
    _common,
    _randomize_norms,
    _save,
    _spread_vision,
    build_tokenizer,
)
from tests.helpers.tiny_qwen3_vl import VIDEO_PAD, _text_and_vision, _tokenizer, _write

LAYER_TYPES = ["linear_attention", "linear_attention", "linear_attention", "full_attention"]
# The releases' rope_parameters at tiny size (theta 1e7; mrope fields unused by a text-only model's positions,
# whose three rows are equal, but kept as the releases' text_config has them).
ROPE: dict[str, Any] = {"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.5,
                        "mrope_section": [2, 1, 1], "mrope_interleaved": True}
# Qwen3-Next's: no multimodal rotary.
NEXT_ROPE: dict[str, Any] = {"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.5}
MOE_FIELDS: dict[str, Any] = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                  shared_expert_intermediate_size=32)


def text_fields(tok, *, rope: dict[str, Any] | None = None, **overrides: Any) -> dict[str, Any]:
    """The tiny hybrid language model's config fields (overrides on top). num_hidden_layers or
    full_attention_interval without layer_types: layer_types left to the config (every interval-th full)."""
    fields = _common(tok, 64, 4, 4, 2, 128, 256, False)
    fields.update(head_dim=16, layer_types=list(LAYER_TYPES), linear_num_key_heads=2, linear_num_value_heads=4,
                  linear_key_head_dim=16, linear_value_head_dim=8, linear_conv_kernel_dim=4,
                  rope_parameters=dict(ROPE if rope is None else rope))
    if ("num_hidden_layers" in overrides or "full_attention_interval" in overrides) and "layer_types" not in overrides:
        fields["layer_types"] = None
    fields.update(overrides)
    return fields


def _randomize(model, *, router_std: float = 0.5) -> None:
    """Norms, the linear attention's decay / step / conv, and the routers (the module docstring's ranges)."""
    import torch

    _randomize_norms(model)
    with torch.no_grad():
        for module in model.modules():
            kind = type(module).__name__
            if kind.endswith("RMSNorm"):
                module.weight.uniform_(-0.5, 0.5)  # zero-centred: the model multiplies by 1 + w
            elif kind.endswith("GatedDeltaNet"):
                module.A_log.copy_(torch.empty_like(module.A_log).uniform_(0.05, 1.0).log_())
                module.dt_bias.uniform_(-1.0, 1.0)
                module.conv1d.weight.normal_(0.0, 0.5)
        for name, param in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                param.normal_(0.0, router_std)


def _build(config, model_cls, seed: int):
    import torch

    config.architectures = [model_cls.__name__]
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32)
    if hasattr(model.model, "visual"):
        _spread_vision(model, ("visual",), scale=lambda name, param: param.dim() == 1 and name.endswith("weight"))
    _randomize(model)
    return model


def _write_partial_rotary(folder: str, sub: str | None = None) -> None:
    """The releases' config.json carries partial_rotary_factor beside rope_parameters too (transformers 5 keeps
    it inside rope_parameters only)."""
    path = os.path.join(folder, "config.json")
    with open(path, encoding="utf-8") as f:
        config = json.load(f)
    text = config[sub] if sub else config
    text["partial_rotary_factor"] = text["rope_parameters"]["partial_rotary_factor"]
    with open(path, "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)


def _text_model(folder, config_cls, model_cls, seed: int, fields: dict[str, Any]) -> str:
    tok = build_tokenizer()
    config = config_cls(**text_fields(tok, **fields))
    model = _build(config, model_cls, seed)
    _save(str(folder), model, tok, max_shard_size=None, generation=None)
    _write_partial_rotary(str(folder))
    return str(folder)


def make_tiny_qwen3_5(folder, *, seed: int = 0, **overrides: Any) -> str:
    """A Qwen3_5ForCausalLM (dense MLP 128 wide); overrides: qwen3_5_text config fields."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    return _text_model(folder, Qwen3_5TextConfig, Qwen3_5ForCausalLM, seed, overrides)


def make_tiny_qwen3_5_moe(folder, *, seed: int = 0, **overrides: Any) -> str:
    """A Qwen3_5MoeForCausalLM: every layer sparse (8 experts of 32, top 2, renormalised: transformers always
    renormalises and the releases' config has no norm_topk_prob) beside a 32-wide gated shared expert; the
    experts saved per expert (`mlp.experts.{e}.gate_proj.weight`, as the releases' files)."""
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    fields = {**MOE_FIELDS, **overrides}
    tok = build_tokenizer()
    params = text_fields(tok, **fields)
    params.pop("intermediate_size")  # no dense MLP in a Qwen3.5-MoE (not a qwen3_5_moe_text field)
    model = _build(Qwen3_5MoeTextConfig(**params), Qwen3_5MoeForCausalLM, seed)
    _save(str(folder), model, tok, max_shard_size=None, generation=None)
    _write_partial_rotary(str(folder))
    return str(folder)


def make_tiny_qwen3_next(folder, *, seed: int = 0, **overrides: Any) -> str:
    """A Qwen3NextForCausalLM: fused in_proj_qkvz / in_proj_ba, per key-head group (models/qwen3_5.py
    split_qwen3_next_projections), the MoE
    of make_tiny_qwen3_5_moe with norm_topk_prob True (the releases'); overrides e.g. mlp_only_layers=[1] or
    decoder_sparse_step=2 for dense (intermediate_size 96) MLP layers."""
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    fields = {"intermediate_size": 96, "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
              **MOE_FIELDS, **overrides}
    tok = build_tokenizer()
    model = _build(Qwen3NextConfig(**text_fields(tok, rope=NEXT_ROPE, **fields)), Qwen3NextForCausalLM, seed)
    _save(str(folder), model, tok, max_shard_size=None, generation=None)
    _write_partial_rotary(str(folder))
    return str(folder)


def _multimodal(folder, config_cls, model_cls, seed: int, text_overrides: dict[str, Any], moe: bool) -> str:
    tok = _tokenizer(video=True)
    start, end, pad = (tok.token_to_id(t) for t in QWEN_VL_TOKENS)
    _, vision = _text_and_vision(tok, 1, ())
    vision.pop("deepstack_visual_indexes")  # Qwen3.5's tower has no DeepStack
    text = text_fields(tok, **{**(MOE_FIELDS if moe else {}), **text_overrides})
    if moe:
        text.pop("intermediate_size")
    config = config_cls(text_config=text, vision_config=vision, image_token_id=pad,
                        video_token_id=tok.token_to_id(VIDEO_PAD), vision_start_token_id=start,
                        vision_end_token_id=end, tie_word_embeddings=False)
    model = _build(config, model_cls, seed)
    _write(folder, model, tok, video=True)
    _write_partial_rotary(str(folder), "text_config")
    return str(folder)


def make_tiny_qwen3_5_multimodal(folder, *, seed: int = 0, **text_overrides: Any) -> str:
    """A Qwen3_5ForConditionalGeneration: make_tiny_qwen3_5's text model, Qwen3-VL's tiny tower (3 blocks of
    16-pixel patches merged 2x2, 4x4 learned positions; no DeepStack), `<|vision_start|>` `<|vision_end|>`
    `<|image_pad|>` `<|video_pad|>` in the tokenizer and config.json, tiny_qwen3_vl's processor files
    (preprocessor_config.json, video_preprocessor_config.json, a chat template writing the placeholders)."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    return _multimodal(folder, Qwen3_5Config, Qwen3_5ForConditionalGeneration, seed, text_overrides, moe=False)


def make_tiny_qwen3_5_moe_multimodal(folder, *, seed: int = 0, **text_overrides: Any) -> str:
    """A Qwen3_5MoeForConditionalGeneration: make_tiny_qwen3_5_moe's text model under the multimodal layout."""
    from transformers import Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration

    return _multimodal(folder, Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration, seed, text_overrides, moe=True)
