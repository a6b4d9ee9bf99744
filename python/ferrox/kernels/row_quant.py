"""Activations quantized per row (per token) in one launch: E4M3 codes with each row's absmax mapped to
448, or int8 codes as vLLM's int8 quantizer rounds them, or a given static scale for every row.

The FP8 and int8 linear runners (layers/quant/fp8_linear.py, int8_linear.py) and the FP8 experts
(kernels/fused_moe.py) quantize their inputs with it; layers/quant/fp8_linear.py holds the torch
version (`quantize_activations_torch`), the CPU path.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ferrox.kernels.int8_codes import int8_code, int8_scale

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
# An all-zero row (a padded batch row, a pruned channel) still gets a finite, nonzero scale.
_MIN_AMAX = 1e-12


@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, scale_ptr, static_scale_ptr, K, stride_x, STATIC: tl.constexpr,
                          QMAX: tl.constexpr, MIN_AMAX: tl.constexpr, BLOCK_K: tl.constexpr,
                          INT8: tl.constexpr):
    """One program per row: its scale (absmax / QMAX, or the static one), then the row in fp8, or
    with INT8 in int8 as vLLM's int8 quantizer rounds (x / scale correctly rounded, to nearest even,
    clamped to [-128, 127]; the scale correctly rounded too: amax / 127 as the CPU divides).
    The second pass re-reads the row from L2; one launch instead of torch's eight."""
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    if STATIC:
        scale = tl.load(static_scale_ptr)
    else:
        amax = tl.zeros([BLOCK_K], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            v = tl.load(x_row + cols, mask=cols < K, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(v))
        if INT8:
            scale = int8_scale(tl.max(amax, axis=0), MIN_AMAX)
        else:
            scale = tl.maximum(tl.max(amax, axis=0), MIN_AMAX) / QMAX
    tl.store(scale_ptr + row, scale)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        v = tl.load(x_row + cols, mask=cols < K, other=0.0).to(tl.float32)
        if INT8:
            q = int8_code(v, scale)
        else:
            q = tl.minimum(tl.maximum(v / scale, -QMAX), QMAX)
        tl.store(q_ptr + row * K + cols, q.to(q_ptr.dtype.element_ty), mask=cols < K)


def quantize_activations_triton(x: torch.Tensor, scale: torch.Tensor | None = None, *,
                                dtype: torch.dtype = FP8_DTYPE) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (fp8 [M, K], float32 [M, 1]): per token (each row's absmax maps to 448) or,
    given `scale` (float32, one element), that scale for every row. dtype=torch.int8: int8 codes
    instead (absmax maps to 127; layers/quant/int8_linear.py)."""
    if dtype not in (FP8_DTYPE, torch.int8):
        raise ValueError(f"activations quantize to float8_e4m3fn or int8, not {dtype}")
    m, k = x.shape
    if x.stride(1) != 1:
        x = x.contiguous()
    q = torch.empty((m, k), dtype=dtype, device=x.device)
    row_scale = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    if m:
        _quantize_rows_kernel[(m,)](x, q, row_scale, scale if scale is not None else row_scale, k, x.stride(0),
                                    STATIC=scale is not None, QMAX=FP8_MAX if dtype == FP8_DTYPE else 127.0,
                                    MIN_AMAX=_MIN_AMAX, BLOCK_K=min(2048, triton.next_power_of_2(k)),
                                    INT8=dtype == torch.int8, num_warps=4)
    return q, row_scale
