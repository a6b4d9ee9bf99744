"""EXAONE 4.0 (LGAI-EXAONE/EXAONE-4.0-32B, -1.2B: Exaone4ForCausalLM), as transformers' Exaone4 defines it:

- post-norm layers (OLMo 2's shape: h = h + post_attention_layernorm(attn(h)); h = h + post_feedforward_layernorm(
  mlp(h)); no input norm), Llama's projections and SiLU MLP;
- q and k RMS-normed per head before rotary (Qwen3's norms: LlamaAttention qk_norm);
- hybrid attention when `sliding_window` is set: the layers `layer_types` names sliding_attention (else
  `sliding_window_pattern`: every N-th layer global, or letters such as "LLLG") attend within the window and
  rotate; the global layers attend fully and do not rotate at all ("global NoPE": models/smollm3.py NoRope).
  Without a window every layer is full attention and rotates (the 1.2B).

The rotary choice follows the layer kinds, not the served windows: a window at least as long as the context
changes the mask (none), not which layers rotate. Decoding takes the general path (post-norm layers are not the
fused one-token kernels' shape). Tensor parallelism as Llama's (the per-head q/k norms share one [head_dim] weight:
nothing of theirs to shard).
GGUF files load dequantized (loader/gguf_families.py).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ferrox.attention.backend import AttentionBackend
from ferrox.layers.layernorm import RMSNorm
from ferrox.layers.ops import DeviceOps
from ferrox.layers.rotary import RotaryEmbedding
from ferrox.model_spec import ModelSpec, UnsupportedModelError, sliding_layer_kinds
from ferrox.models.layer_stack import PerLayerRopeStack
from ferrox.models.llama import LlamaAttention, LlamaForCausalLM
from ferrox.models.post_norm import PostNormDecoderLayer


def rotary_layers(config: dict[str, Any], num_layers: int) -> tuple[bool, ...]:
    """Which layers rotate q and k: all without a sliding window, else the sliding ones."""
    if not config.get("sliding_window"):
        return (True,) * num_layers
    return sliding_layer_kinds(config, num_layers, "config.json")


class Exaone4Model(PerLayerRopeStack):
    def __init__(self, spec: ModelSpec, backend: AttentionBackend, ops: DeviceOps, dtype: torch.dtype,
                 device: torch.device | str, **_: Any):
        layers: list[nn.Module] = [
            PostNormDecoderLayer(spec, LlamaAttention(spec, backend, ops, dtype, device, qkv_bias=False, o_bias=False,
                                                      qk_norm=True, window=spec.window_of(i)), ops, dtype, device)
            for i in range(spec.num_layers)]
        super().__init__(spec, backend, dtype, device, layers,
                         RMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype, device, ops),
                         RotaryEmbedding.for_spec(spec, device, ops), rotary_layers(spec.hf_config, spec.num_layers))


class Exaone4ForCausalLM(LlamaForCausalLM):
    model_class = Exaone4Model
    supports_tensor_parallel = True  # (Qwen3's per-head q/k norms: one [head_dim] weight on every rank)
    supports_quantized_gguf = False  # (a GGUF file loads dequantized: loader/gguf_families.py)

    def __init__(self, spec: ModelSpec, dtype: torch.dtype, device: torch.device | str, *,
                 kernels: str | None = None):
        config = spec.hf_config
        for key in ("attention_bias", "mlp_bias"):
            if config.get(key):
                raise UnsupportedModelError(f"config.json: {key} true is not supported for Exaone4ForCausalLM "
                                            "(transformers' EXAONE 4 layers carry no biases)")
        rotary_layers(config, spec.num_layers)  # (a bad layer_types or pattern fails here, by name)
        super().__init__(spec, dtype, device, kernels=kernels)


__all__ = ["Exaone4ForCausalLM"]
