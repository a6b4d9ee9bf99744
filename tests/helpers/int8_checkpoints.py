"""A reference int8 quantizer for tests: llm-compressor's compressed-tensors int8 layout ("int-quantized",
W8A8 and W8A16) written from a tiny float HF folder (tiny_models.make_tiny_llama), and the reference
model it must match: transformers with every decoder projection's weight dequantized and its input
fake-quantized as the scheme says.

Written from the format's description, independently of ferrox's loader and runner:

- weights: symmetric round-to-nearest, scale = absmax / 127 per output row ("channel", stored [out, 1])
  or over the tensor ("tensor", stored [1]); `weight` int8 [out, in]; W = weight * scale;
- activations: symmetric, scale = absmax / 127 per token ("token", dynamic), over the whole input
  tensor ("tensor", dynamic), or the checkpoint's `input_scale` [1] ("tensor", static); codes
  clamp(round_half_to_even(x / scale), -128, 127). A merged layer (q/k/v, gate/up) reads one input,
  so vLLM (and ferrox) quantize it with the largest of its shards' static scales;
- optional all-zero `weight_zero_point` / `input_zero_point` int8 tensors, as some exports write them;
- weight-only int8 may come packed ("pack-quantized"): `weight_packed` int32 [out, ceil(in / 4)], each
  value plus 128, input 4w + i in byte i of word w, and `weight_shape` (out, in).
"""

from __future__ import annotations

from typing import Any

import torch

from tests.helpers.quant_checkpoints import PROJ, dequantized_reference

INT8_ARGS = {"num_bits": 8, "type": "int", "symmetric": True, "group_size": None, "block_structure": None,
             "actorder": None, "observer": "minmax", "observer_kwargs": {}}


def quantize_weight(w: torch.Tensor, strategy: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 codes [out, in], float32 scale [out, 1] ("channel") or [1] ("tensor"))."""
    wf = w.double()
    amax = wf.abs().amax(dim=1, keepdim=True) if strategy == "channel" else wf.abs().amax().reshape(1)
    scale = (amax / 127).clamp(min=1e-12).float()
    codes = torch.round(wf / scale.double()).clamp(-128, 127).to(torch.int8)
    return codes, scale


def fake_quantize(x: torch.Tensor, scale: float | None, per_token: bool) -> torch.Tensor:
    """x rounded through int8 (in float32, the engine's arithmetic): per token, per tensor (scale
    None, per_token False) or with a static scale."""
    xf = x.float()
    if scale is not None:
        s = torch.tensor(scale, dtype=torch.float32)
    elif per_token:
        s = xf.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / 127.0
    else:
        s = xf.abs().amax().clamp(min=1e-12) / 127.0
    return torch.round((xf / s).clamp(-128, 127)) * s  # torch.round: half to even


def int8_config(weights: str, activations: str | None, *, fmt: str = "int-quantized") -> dict[str, Any]:
    """config.json quantization_config as llm-compressor writes it; activations "token" (dynamic),
    "tensor" (dynamic), "static" (tensor) or None (weight-only)."""
    inputs = None
    if activations is not None:
        inputs = {**INT8_ARGS, "strategy": "token" if activations == "token" else "tensor",
                  "dynamic": activations != "static", "observer": None if activations != "static" else "minmax"}
    return {
        "quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed",
        "version": "0.10.2", "global_compression_ratio": None, "kv_cache_scheme": None, "sparsity_config": {},
        "transform_config": {}, "ignore": ["lm_head"],
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": {**INT8_ARGS, "strategy": weights,
                                                                          "dynamic": False},
                                      "input_activations": inputs, "output_activations": None, "format": fmt}},
    }


def int8_tensors(float_weights: dict[str, torch.Tensor], weights: str, *,
                 input_scales: dict[str, float] | None = None, scale_dtype: torch.dtype = torch.bfloat16,
                 zero_points: bool = False) -> dict[str, torch.Tensor]:
    """The float checkpoint with every decoder projection in int8 (weight, weight_scale, and where
    given input_scale [1]; zero_points: all-zero weight_zero_point / input_zero_point beside them)."""
    out = {}
    for name, w in float_weights.items():
        module = name.rsplit(".", 1)[0]
        if not module.endswith(PROJ) or not name.endswith(".weight"):
            out[name] = w
            continue
        codes, scale = quantize_weight(w, weights)
        out[name] = codes
        out[f"{module}.weight_scale"] = scale.to(scale_dtype)
        if zero_points:
            out[f"{module}.weight_zero_point"] = torch.zeros(scale.shape, dtype=torch.int8)
        if input_scales is not None:
            out[f"{module}.input_scale"] = torch.tensor([input_scales[module]], dtype=torch.float32)
            if zero_points:
                out[f"{module}.input_zero_point"] = torch.zeros(1, dtype=torch.int8)
    return out


def pack_int8(codes: torch.Tensor) -> torch.Tensor:
    """int8 [out, in] -> int32 [out, ceil(in / 4)] as the 'pack-quantized' format stores 8-bit ints:
    each value plus 128, four consecutive inputs per word, input 4w + i in bits [8i, 8i + 8)."""
    stored = codes.to(torch.int64) + 128
    stored = torch.nn.functional.pad(stored, (0, -stored.shape[1] % 4))
    words = sum(stored[:, i::4] << (8 * i) for i in range(4))
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def packed_int8_tensors(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """int8_tensors' checkpoint with each projection's `weight` stored packed: `weight_packed` and
    `weight_shape` (the weight-only W8A16 scheme in the 'pack-quantized' format)."""
    out = {}
    for name, value in tensors.items():
        module = name.rsplit(".", 1)[0]
        if name.endswith(".weight") and module.endswith(PROJ):
            out[f"{module}.weight_packed"] = pack_int8(value)
            out[f"{module}.weight_shape"] = torch.tensor(value.shape, dtype=torch.int64)
        else:
            out[name] = value
    return out


def reference_model(float_folder: str, tensors: dict[str, torch.Tensor], activations: str | None):
    """transformers (float32) with the dequantized projections of `tensors` and their inputs rounded
    through int8: activations "token", "tensor" (dynamic, over the step's whole input), "static"
    (the checkpoint's input scales, a merged layer's largest) or None (weight-only)."""
    if activations is None:
        return dequantized_reference(float_folder, tensors)
    return dequantized_reference(float_folder, tensors, lambda x, static: fake_quantize(
        x, static if activations == "static" else None, activations == "token"))
