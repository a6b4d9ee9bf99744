"""IBM Granite 3.x dense: the Llama decoder with four scalars of config.json, folded into the weights
at load time so that every kernel and device path runs it as a Llama.

transformers' Granite computes
    h = embed(ids) * embedding_multiplier
    h = h + attn(norm(h)) * residual_multiplier      (scores scaled by attention_multiplier)
    h = h + mlp(norm(h)) * residual_multiplier
    logits = lm_head(norm(h)) / logits_scaling
All four are linear in a weight, so ferrox folds them in (in float32, rounded once into the model
dtype, before any online quantization):
- embed_tokens rows times embedding_multiplier;
- o_proj and down_proj weights (and biases) times residual_multiplier (a LoRA delta on them gets it
  too: Linear.output_scale);
- the final norm's weight divided by logits_scaling, and also by embedding_multiplier when the LM
  head is the (scaled) embedding: logits are linear in the normed hidden state, so this is exact;
- attention_multiplier is the attention layers' softmax scale (ModelSpec.attention_scale), which
  every attention path reads from the layer.
The final hidden states are therefore those of transformers divided by `hidden_states_scale`; the
pooling runner multiplies pooled vectors back (worker/pooling_runner.py).

Refused by name: checkpoint quantization (config.json quantization_config: the folds would have to
reach inside packed weights and their scales). GGUF files of llama.cpp's "granite" architecture load
(loader/model_config.py maps its *_scale keys to these fields) dequantized to the model dtype, for
the same reason: the CPU's kept-quantized path has no place for the folds.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from ferrox.distributed.sharding import scaled
from ferrox.layers.linear import RowParallelLinear
from ferrox.layers.quant.method import hf_quantization_config
from ferrox.model_spec import ModelSpec, UnsupportedModelError
from ferrox.models.llama import LlamaForCausalLM


@dataclasses.dataclass(frozen=True, slots=True)
class GraniteMultipliers:
    """config.json's scalars, with transformers' GraniteConfig defaults (1.0 each: note that a missing
    attention_multiplier is a softmax scale of 1, not head_dim ** -0.5)."""

    embedding: float = 1.0
    residual: float = 1.0
    attention: float = 1.0
    logits_scaling: float = 1.0

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> GraniteMultipliers:
        fields = {"embedding": "embedding_multiplier", "residual": "residual_multiplier",
                  "attention": "attention_multiplier", "logits_scaling": "logits_scaling"}
        values: dict[str, float] = {}
        for attr, key in fields.items():
            value = config.get(key, 1.0)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise UnsupportedModelError(f"config.json: {key} must be a positive number, got {value!r}")
            values[attr] = float(value)
        return cls(**values)


class GraniteForCausalLM(LlamaForCausalLM):
    supports_quantized_gguf = False  # GGUF files load dequantized: see the module docstring

    def __init__(self, spec: ModelSpec, dtype: torch.dtype, device: torch.device | str, *,
                 kernels: str | None = None):
        quant = hf_quantization_config(spec.hf_config)
        if quant is not None:
            raise UnsupportedModelError(
                f"config.json: quantization_config (quant_method {quant.get('quant_method')!r}) is not supported for "
                "GraniteForCausalLM: its embedding, residual and logits multipliers are folded into the weights at "
                "load, which quantized tensors do not allow; load the unquantized checkpoint, with quantization='fp8' "
                "to quantize it at load time")
        multipliers = GraniteMultipliers.from_config(spec.hf_config)
        super().__init__(dataclasses.replace(spec, attention_scale=multipliers.attention), dtype, device,
                         kernels=kernels)
        self.multipliers = multipliers
        tied = self.lm_head is None
        # transformers' final hidden states = ours * this (the final norm carries 1 / it).
        self.hidden_states_scale = multipliers.logits_scaling * (multipliers.embedding if tied else 1.0)
        # transformers multiplies inputs_embeds by embedding_multiplier after the lookup; ferrox's embedding rows
        # carry it, so a prompt of embeddings (get_input_embeddings() output) gets it here (worker/multimodal.py).
        self.prompt_embeds_scale = multipliers.embedding
        for module in self.model.layers.modules():
            if isinstance(module, RowParallelLinear):  # o_proj and down_proj: the layers feeding the residual
                module.output_scale = multipliers.residual

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        super().load_weights(self._fold(weights))

    def _fold(self, weights: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
        """The checkpoint stream with the multipliers folded in (module docstring)."""
        m = self.multipliers
        for name, tensor in weights:
            prefix, _, leaf = name.rpartition(".")
            module = prefix.rpartition(".")[2]
            if module in ("o_proj", "down_proj") and leaf in ("weight", "bias"):
                factor = m.residual
            elif name == "model.embed_tokens.weight":
                factor = m.embedding
            elif name == "model.norm.weight":
                factor = 1.0 / self.hidden_states_scale
            else:
                factor = 1.0
            yield name, tensor if factor == 1.0 else scaled(tensor, factor)
