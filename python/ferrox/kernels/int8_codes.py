"""int8 activation codes as vLLM's int8 W8A8 layers round them, for the Triton kernels that quantize
an input (layers/quant/fp8_linear.py's row quantizer in its int8 variant, and the one-token W8A8
products in w8a8_dot_gemv.py and gemv.py's qkv kernel): q = clamp(round_half_even(x / scale),
-128, 127), the division correctly rounded (as the CPU's), so every path gives the same codes."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def round_half_even(v):
    """v rounded to the nearest integer, ties to even (C's rint, torch.round): floor, then up past
    a half, or at a half when floor is odd. Exact for |v| < 2^22 in fp32. (libdevice's rint would
    be one instruction, but the Triton interpreter runs no libdevice calls.)"""
    f = tl.floor(v)
    frac = v - f
    odd = f - 2.0 * tl.floor(f * 0.5)  # 1.0 for an odd floor, else 0.0
    return tl.where((frac > 0.5) | ((frac == 0.5) & (odd == 1.0)), f + 1.0, f)


@triton.jit
def int8_code(v, scale):
    """fp32 values v at `scale` as integer-valued fp32 codes in [-128, 127]. Clamped first (to
    integers: the same result), so the rounding stays exact."""
    return round_half_even(tl.minimum(tl.maximum(tl.math.div_rn(v, scale), -128.0), 127.0))


@triton.jit
def int8_scale(amax, min_amax):
    """The per-token scale of an input whose absmax is amax: amax / 127, correctly rounded (as the
    CPU divides), an all-zero input kept at a finite, nonzero scale."""
    return tl.math.div_rn(tl.maximum(amax, min_amax), 127.0)

