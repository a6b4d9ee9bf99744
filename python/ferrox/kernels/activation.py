"""SiLU-and-mul: the gated MLP's `silu(gate) * up` on the fused [gate | up] projection output.

Reads the 2*I-wide row once and writes the I-wide result, instead of eager torch's three passes
(silu, a temporary, the product).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _silu_and_mul_kernel(out_ptr, x_ptr, inter, stride_x, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + inter + cols, mask=mask, other=0.0).to(tl.float32)
    silu = gate / (1.0 + tl.exp(-gate))
    tl.store(out_ptr + row * stride_o + cols, (silu * up).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [tokens, 2 * intermediate] -> [tokens, intermediate]."""
    if x.dim() != 2 or x.shape[1] % 2:
        raise ValueError(f"silu_and_mul needs x [tokens, 2 * intermediate], got {tuple(x.shape)}")
    if x.stride(-1) != 1:
        raise ValueError("silu_and_mul needs a contiguous last axis")
    inter = x.shape[1] // 2
    out = torch.empty(x.shape[0], inter, dtype=x.dtype, device=x.device)
    if x.shape[0] == 0:
        return out
    block = min(1024, triton.next_power_of_2(inter))
    _silu_and_mul_kernel[(x.shape[0], triton.cdiv(inter, block))](
        out, x, inter, x.stride(0), out.stride(0), BLOCK=block, num_warps=4
    )
    return out
