"""SmolLM3 (HuggingFaceTB/SmolLM3-3B: SmolLM3ForCausalLM): the Llama decoder with NoPE layers.

As transformers' SmolLM3 defines it, config.json's `no_rope_layers` lists one flag a layer: 1 rotates q and k
(rotary), 0 leaves them as projected (no position encoding: "NoPE"). Without the list, every
`no_rope_layer_interval`-th layer (default 4: layers 3, 7, 11, ...) is a NoPE layer. A NoPE layer takes an
identity rope (`NoRope`, layers/ops.py) in place of the step's rotary; everything else is Llama's.

Sliding windows: transformers applies `sliding_window` only when `use_sliding_window` is true (default
false), on the layers `layer_types` names "sliding_attention", which it derives, when config.json has no
layer_types, as the NoPE layers. The loader's spec reads windows for every family (use_sliding_window
absent counts as on there, layer_types absent as every layer), so this class puts SmolLM3's reading back.

One-token decode steps take the fused kernels (attention/fused_decode.py) as Llama's do, a NoPE layer
with the identity rotation (cos 1, sin 0: OneTokenLayer.rotary False). The CPU Rust decoder (attention/
cpu_decode.py) rotates every layer, so quantized GGUF files are not kept packed (supports_quantized_gguf
False; llama.cpp's smollm3 has no GGUF mapping here either, so such files are refused by architecture).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ferrox.attention.backend import AttentionBackend
from ferrox.layers.ops import NO_ROPE, DeviceOps, NoRope
from ferrox.model_spec import ModelLoadError, ModelSpec, UnsupportedModelError
from ferrox.models.llama import LlamaForCausalLM, LlamaModel

# transformers' SmolLM3Config default: every 4th layer has no rotary.
DEFAULT_NO_ROPE_LAYER_INTERVAL = 4




def rotary_layers(config: dict[str, Any], num_layers: int) -> tuple[bool, ...]:
    """Which layers rotate q and k: config.json's no_rope_layers (1: rotary), else every layer but each
    no_rope_layer_interval-th, as transformers' SmolLM3Config derives it."""
    flags = config.get("no_rope_layers")
    if flags is None:
        interval = config.get("no_rope_layer_interval", DEFAULT_NO_ROPE_LAYER_INTERVAL)
        if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
            raise ModelLoadError(f"config.json: field 'no_rope_layer_interval' must be a positive integer, "
                                 f"got {interval!r}")
        return tuple((i + 1) % interval != 0 for i in range(num_layers))
    if not isinstance(flags, list) or len(flags) != num_layers or any(f not in (0, 1) for f in flags):
        raise ModelLoadError(f"config.json: field 'no_rope_layers' must list 0 or 1 for each of the {num_layers} "
                             f"layers, got {flags!r}")
    return tuple(bool(f) for f in flags)


def smollm3_spec(spec: ModelSpec) -> ModelSpec:
    """The spec with SmolLM3's sliding windows: none unless use_sliding_window; else on the layers
    layer_types names, or (no layer_types) on the NoPE layers."""
    config = spec.hf_config
    use_window = bool(config.get("use_sliding_window", False))
    if not use_window and config.get("sliding_window") and "sliding_attention" in (config.get("layer_types") or []):
        # transformers' layers then attend in full while its sdpa / eager masks apply the window.
        raise UnsupportedModelError("config.json: layer_types names sliding_attention layers while "
                                    "use_sliding_window is false, which transformers' SmolLM3 reads both ways; "
                                    "set use_sliding_window true (window on those layers) or drop layer_types")
    if spec.sliding_window is None:
        return spec
    if not use_window:
        return dataclasses.replace(spec, sliding_window=None, sliding_layers=None, attention_windows=())
    if config.get("layer_types") is not None:
        return spec  # the loader read them
    sliding = tuple(not rotary for rotary in rotary_layers(config, spec.num_layers))
    # (attention_windows is set when the served context exceeds the window: spec_for_context)
    windows = tuple(spec.sliding_window if s else 0 for s in sliding) if spec.attention_windows else ()
    return dataclasses.replace(spec, sliding_layers=sliding, attention_windows=windows)


class SmolLM3Model(LlamaModel):
    def __init__(self, spec: ModelSpec, backend: AttentionBackend, ops: DeviceOps, dtype: torch.dtype,
                 device: torch.device | str, **kwargs: Any):
        super().__init__(spec, backend, ops, dtype, device, **kwargs)
        self.rotary_layers = rotary_layers(spec.hf_config, spec.num_layers)
        if self.one_token_layers is not None and not all(self.rotary_layers):
            # The fused one-token path gives NoPE layers the identity rotation (OneTokenLayer.rotary).
            self.one_token_layers = [dataclasses.replace(view, rotary=rotary)
                                     for view, rotary in zip(self.one_token_layers, self.rotary_layers, strict=True)]
            self.decode_path = backend.decode_path(self.one_token_layers, self.rotary.rope_rows)

    def forward(self, input_ids, positions, kv_caches, meta, inputs_embeds=None):
        h = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        if self.decode_path.takes_step(h.shape[0], kv_caches, meta):
            return self.norm(self.decode_path.forward(h, positions, kv_caches, meta))
        rope = self.rotary(positions, h.dtype)
        residual = None
        for i, layer in enumerate(self.layers):
            h, residual = layer(h, residual, rope if self.rotary_layers[i] else NO_ROPE, kv_caches[i], meta)
        h, _ = self.norm(h, residual)
        return h


class SmolLM3ForCausalLM(LlamaForCausalLM):
    model_class = SmolLM3Model
    supports_quantized_gguf = False  # (no GGUF mapping: loader/gguf_file.py; see the module docstring)

    def __init__(self, spec: ModelSpec, dtype: torch.dtype, device: torch.device | str, *,
                 kernels: str | None = None):
        super().__init__(smollm3_spec(spec), dtype, device, kernels=kernels)


__all__ = ["NO_ROPE", "NoRope", "SmolLM3ForCausalLM", "rotary_layers", "smollm3_spec"]
