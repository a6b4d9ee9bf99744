"""MXFP4 (OCP microscaling FP4) weights, dequantized at load time: how gpt-oss's checkpoints store
their experts (config.json quantization_config {"quant_method": "mxfp4"}).

A weight `W` [..., rows, cols] is stored as two tensors:

- `W_blocks` uint8 [..., rows, cols / 32, 16]: each group of 32 consecutive values of a row packed
  two to a byte, FP4 E2M1 codes, the even element in the low nibble and the odd one in the high;
- `W_scales` uint8 [..., rows, cols / 32]: each group's E8M0 scale, the exponent of a power of two
  with bias 127 (value = code * 2 ** (scale - 127)).

E2M1 codes: sign bit 3, then 0, 0.5, 1, 1.5, 2, 3, 4, 6. On the Triton kernels the experts stay in
this form (layers/quant/mxfp4_moe.py; kernels/fused_moe.py dequantizes in its K loops); elsewhere
`dequantize_mxfp4` expands them to the model dtype once while loading, and it is the kernels' reference.
"""

from __future__ import annotations

import torch

GROUP = 32  # values per scale
# The 16 E2M1 codes' values (bit 3 the sign).
FP4_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
_SCALE_BIAS = 127


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[..., G, 16] uint8 blocks and [..., G] uint8 scales -> [..., G * 32] values in `dtype`
    (each value exact in float32 and bfloat16: a 2-bit mantissa times a power of two)."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.dim() < 2 or blocks.shape[-1] != GROUP // 2 or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not match "
                         f"([..., G, {GROUP // 2}] and [..., G])")
    table = torch.tensor(FP4_E2M1_VALUES, dtype=torch.float32, device=blocks.device)
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).flatten(-2)  # [..., G, 32]: low nibble first
    values = table[codes.long()]
    exponents = scales.to(torch.int32) - _SCALE_BIAS
    out = torch.ldexp(values, exponents.unsqueeze(-1))
    return out.flatten(-2).to(dtype)


def quantize_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse for tests and tools: [..., cols] (cols a multiple of 32) -> (blocks, scales), each
    group scaled by the power of two that brings its largest magnitude to at most 6, and each value
    rounded to the nearest E2M1 code. Values already on that grid round-trip exactly."""
    if weight.shape[-1] % GROUP:
        raise ValueError(f"MXFP4 groups are {GROUP} values: the last dim {weight.shape[-1]} is not a multiple")
    groups = weight.float().unflatten(-1, (-1, GROUP))  # [..., G, 32]
    amax = groups.abs().amax(-1).clamp(min=2.0 ** -126)
    exponents = (torch.ceil(torch.log2(amax / 6.0))).clamp(-_SCALE_BIAS, 127).to(torch.int32)
    scaled = groups / torch.ldexp(torch.ones_like(amax), exponents).unsqueeze(-1)
    table = torch.tensor(FP4_E2M1_VALUES[:8], dtype=torch.float32, device=weight.device)
    magnitude = (scaled.abs().unsqueeze(-1) - table).abs().argmin(-1)  # nearest of the 8 magnitudes
    codes = (magnitude | torch.where(scaled < 0, 8, 0)).to(torch.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks.contiguous(), (exponents + _SCALE_BIAS).to(torch.uint8)
