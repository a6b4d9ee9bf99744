"""OPT (facebook/opt-125m ... opt-66b: OPTForCausalLM), as transformers' OPT defines it -- the model of vLLM's
quickstart: GPT-2's decoder shape (models/gpt2.py LearnedPositionsModel) with

- learned positions offset by 2 (row position + 2 of `embed_positions`);
- LayerNorm before attention (`self_attn_layer_norm`) and before the ReLU MLP (fc1 -> relu -> fc2, `final_layer_norm`
  inside each layer), biases everywhere (`enable_bias`), the decoder's final LayerNorm;
- the LM head tied to the token embedding.

Refused by name: the post-LayerNorm layout (`do_layer_norm_before` false: opt-350m) and its projections
(`word_embed_proj_dim` other than hidden_size), `enable_bias` false, `_remove_final_layer_norm`, another activation,
GGUF files.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from ferrox.attention.backend import AttentionBackend
from ferrox.layers.ops import DeviceOps
from ferrox.model_spec import ModelSpec, UnsupportedModelError
from ferrox.models.gpt2 import LearnedPositionsModel
from ferrox.models.gpt_neox import renamed
from ferrox.models.llama import LlamaForCausalLM

_RENAMES = (("model.decoder.embed_tokens.", "model.embed_tokens."), ("model.decoder.embed_positions.",
                                                                       "model.embed_positions."),
            ("model.decoder.final_layer_norm.", "model.norm."), ("model.decoder.layers.", "model.layers."),
            (".self_attn_layer_norm.", ".input_layernorm."), (".final_layer_norm.", ".post_attention_layernorm."),
            (".self_attn.out_proj.", ".self_attn.o_proj."), (".fc1.", ".mlp.up_proj."), (".fc2.", ".mlp.down_proj."))


class OPTModel(LearnedPositionsModel):
    position_offset = 2

    def __init__(self, spec: ModelSpec, backend: AttentionBackend, ops: DeviceOps, dtype: torch.dtype,
                 device: torch.device | str, **_: Any):
        super().__init__(spec, backend, ops, dtype, device, eps=1e-5, act=nn.ReLU)


class OPTForCausalLM(LlamaForCausalLM):
    model_class = OPTModel
    supports_quantized_gguf = False  # (no GGUF mapping: loader/gguf_file.py)

    def __init__(self, spec: ModelSpec, dtype: torch.dtype, device: torch.device | str, *,
                 kernels: str | None = None):
        config = spec.hf_config
        if config.get("do_layer_norm_before", True) is False:
            raise UnsupportedModelError("config.json: do_layer_norm_before false (the post-LayerNorm layers of "
                                        "opt-350m) is not supported for OPTForCausalLM")
        proj = config.get("word_embed_proj_dim")
        if proj is not None and proj != spec.hidden_size:
            raise UnsupportedModelError(f"config.json: word_embed_proj_dim {proj} (embedding projections) is not "
                                        "supported for OPTForCausalLM")
        for key, bad in (("enable_bias", False), ("_remove_final_layer_norm", True),
                         ("layer_norm_elementwise_affine", False)):
            if config.get(key, not bad) is bad:
                raise UnsupportedModelError(f"config.json: {key} {str(bad).lower()} is not supported for "
                                            "OPTForCausalLM")
        act = config.get("activation_function", "relu")
        if act != "relu":
            raise UnsupportedModelError(f"config.json: activation_function {act!r} is not supported for "
                                        "OPTForCausalLM (relu)")
        ffn = config.get("ffn_dim")
        spec = dataclasses.replace(spec, tie_word_embeddings=bool(config.get("tie_word_embeddings", True)),
                                   attention_bias=True, mlp_bias=True,
                                   intermediate_size=int(ffn) if ffn else spec.intermediate_size)
        super().__init__(spec, dtype, device, kernels=kernels)

    def _hf_names(self, weights: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
        for name, tensor in weights:
            if not name.startswith(("model.", "lm_head.")):
                name = "model." + name  # (the bare OPTModel checkpoints: decoder.layers.0...)
            yield renamed(name, _RENAMES), tensor

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        super().load_weights(self._hf_names(weights))


__all__ = ["OPTForCausalLM"]
