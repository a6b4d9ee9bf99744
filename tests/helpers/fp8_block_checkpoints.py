"""A reference block-wise FP8 quantizer for tests: DeepSeek-V3's layout (Qwen3-*-FP8 and others publish
it) written from a tiny float HF folder (tiny_models.make_tiny_llama), and the reference model it must
match: transformers with every decoder projection's weight dequantized and its input fake-quantized
per token and group.

Written from the format's description, independently of ferrox's loader and kernels:

- config.json quantization_config {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme":
  "dynamic", "weight_block_size": [BN, BK]};
- per projection `weight` float8_e4m3fn [out, in] and `weight_scale_inv` float32 [ceil(out / BN),
  ceil(in / BK)]: each BN x BK block's absmax maps to 448, W = weight * weight_scale_inv[block];
- activations: per token and per group of BK inputs, scale = absmax / 448, codes
  clamp(x / scale, -448, 448) in E4M3 (round to nearest even), x ~= codes * scale.
"""

from __future__ import annotations

from typing import Any

import torch

from tests.helpers.quant_checkpoints import PROJ, dequantized_reference

FP8 = torch.float8_e4m3fn


def block_config(block: tuple[int, int], layout: str = "fp8") -> dict[str, Any]:
    """quantization_config: the fp8 layout's, or (layout "compressed-tensors") llm-compressor's FP8_BLOCK
    scheme, which stores the same tensors with the scales named `weight_scale`."""
    if layout == "fp8":
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(block)}
    args = {"num_bits": 8, "type": "float", "symmetric": True, "actorder": None, "observer": "minmax",
            "observer_kwargs": {}}
    return {
        "quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
        "ignore": ["lm_head"], "kv_cache_scheme": None, "sparsity_config": {},
        "config_groups": {"group_0": {
            "targets": ["Linear"], "format": "float-quantized", "output_activations": None,
            "weights": {**args, "strategy": "block", "block_structure": list(block), "group_size": None,
                        "dynamic": False},
            "input_activations": {**args, "strategy": "group", "group_size": block[1], "block_structure": None,
                                  "dynamic": True, "observer": None}}},
    }


def quantize_blocks(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 codes [out, in], float32 scales [ceil(out / BN), ceil(in / BK)]), block by block."""
    bn, bk = block
    out, k = w.shape
    codes = torch.empty(out, k, dtype=FP8)
    scales = torch.empty(-(-out // bn), -(-k // bk), dtype=torch.float32)
    for i in range(scales.shape[0]):
        for j in range(scales.shape[1]):
            tile = w[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk].float()
            s = max(float(tile.abs().max()), 1e-12) / 448.0
            scales[i, j] = s
            codes[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk] = (tile / scales[i, j]).clamp(-448, 448).to(FP8)
    return codes, scales


def dequantize_blocks(codes: torch.Tensor, scales: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    bn, bk = block
    full = scales.repeat_interleave(bn, dim=0).repeat_interleave(bk, dim=1)
    return codes.float() * full[:codes.shape[0], :codes.shape[1]]


def block_tensors(float_weights: dict[str, torch.Tensor], block: tuple[int, int],
                  scale_name: str = "weight_scale_inv") -> dict[str, torch.Tensor]:
    """The float checkpoint with every decoder projection's weight block-quantized (scales named
    `scale_name`: compressed-tensors calls them weight_scale)."""
    out = {}
    for name, w in float_weights.items():
        module = name.rsplit(".", 1)[0]
        if module.endswith(PROJ) and name.endswith(".weight"):
            out[name], out[f"{module}.{scale_name}"] = quantize_blocks(w, block)
        else:
            out[name] = w
    return out


def fake_quantize_groups(x: torch.Tensor, group: int) -> torch.Tensor:
    """x rounded through E4M3 per token and per group of `group` inputs (float32)."""
    xf = x.float()
    k = xf.shape[-1]
    out = torch.empty_like(xf)
    for start in range(0, k, group):
        part = xf[..., start:start + group]
        s = part.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / 448.0
        out[..., start:start + group] = (part / s).clamp(-448, 448).to(FP8).float() * s
    return out


def reference_model(float_folder: str, tensors: dict[str, torch.Tensor], block: tuple[int, int]):
    """transformers with the dequantized weights, every projection's input fake-quantized per group."""
    dequantized = {}
    for name, value in tensors.items():
        if name.endswith((".weight_scale_inv", ".weight_scale")):
            module = name.rsplit(".", 1)[0]
            dequantized[f"{module}.weight"] = dequantize_blocks(tensors[f"{module}.weight"], value, block)
            dequantized[f"{module}.weight_scale"] = torch.ones(1)
    return dequantized_reference(float_folder, dequantized,
                                 lambda x, static: fake_quantize_groups(x, block[1]).to(x.dtype))
