"""Arcee AFM (arcee-ai/AFM-4.5B: ArceeForCausalLM), as transformers' Arcee defines it: Llama's layers with an ungated
ReLU-squared MLP (`hidden_act` "relu2": down_proj(relu(up_proj(x))^2), models/ungated_mlp.py). Decoding takes the
general path (the fused one-token kernels run SiLU-gated MLPs). Tensor parallelism comes with Llama's projections.
Refused by name: another hidden_act. GGUF files load dequantized (loader/gguf_families.py)."""

from __future__ import annotations

import torch

from ferrox.model_spec import ModelSpec, UnsupportedModelError
from ferrox.models.llama import LlamaForCausalLM, LlamaModel
from ferrox.models.ungated_mlp import ReluSquaredMLP


class ArceeModel(LlamaModel):
    mlp_class = ReluSquaredMLP
    fused_one_token = False


class ArceeForCausalLM(LlamaForCausalLM):
    model_class = ArceeModel
    supports_quantized_gguf = False  # (a GGUF file loads dequantized: loader/gguf_families.py)

    def __init__(self, spec: ModelSpec, dtype: torch.dtype, device: torch.device | str, *,
                 kernels: str | None = None):
        if spec.hidden_act != "relu2":
            raise UnsupportedModelError(f"config.json: hidden_act {spec.hidden_act!r} is not supported for "
                                        "ArceeForCausalLM (its MLP is relu2)")
        super().__init__(spec, dtype, device, kernels=kernels)


__all__ = ["ArceeForCausalLM"]
