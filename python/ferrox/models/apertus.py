"""Apertus (swiss-ai/Apertus-8B-Instruct-2509, -70B: ApertusForCausalLM), as transformers' Apertus defines it: Llama's
pre-norm layers (their norms named `attention_layernorm` / `feedforward_layernorm`, renamed at load) with q and k
RMS-normed per head before rotary (Qwen3's norms) and an ungated xIELU MLP whose activation has learned parameters per
layer (models/ungated_mlp.py). Decoding takes the general path (the fused one-token kernels run SiLU-gated MLPs).
Tensor parallelism comes with Llama's projections. Refused by name: another hidden_act, GGUF files."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

from ferrox.model_spec import ModelSpec, UnsupportedModelError
from ferrox.models.llama import LlamaForCausalLM, LlamaModel
from ferrox.models.ungated_mlp import XieluMLP

_NORM_NAMES = {".attention_layernorm.": ".input_layernorm.", ".feedforward_layernorm.": ".post_attention_layernorm."}


def _renamed(weights: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
    for name, tensor in weights:
        for old, new in _NORM_NAMES.items():
            name = name.replace(old, new)
        yield name, tensor


class ApertusModel(LlamaModel):
    mlp_class = XieluMLP
    fused_one_token = False


class ApertusForCausalLM(LlamaForCausalLM):
    model_class = ApertusModel
    qk_norm = True
    supports_quantized_gguf = False  # (no GGUF mapping: loader/gguf_file.py)

    def __init__(self, spec: ModelSpec, dtype: torch.dtype, device: torch.device | str, *,
                 kernels: str | None = None):
        if spec.hidden_act != "xielu":
            raise UnsupportedModelError(f"config.json: hidden_act {spec.hidden_act!r} is not supported for "
                                        "ApertusForCausalLM (its MLP is xielu)")
        super().__init__(spec, dtype, device, kernels=kernels)

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        super().load_weights(_renamed(weights))


__all__ = ["ApertusForCausalLM"]
