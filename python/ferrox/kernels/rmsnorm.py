"""Fused RMSNorm, optionally with the residual add of the pre-norm transformer block.

    residual_out = x + residual                      (rounded to the activation dtype, as an eager add is)
    out          = weight * (residual_out * rsqrt(mean(residual_out^2) + eps))   (statistics in fp32)

One program per row; the whole hidden vector stays in registers, so x and residual are read
once and both outputs written once (eager torch reads the sum again for the norm).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ferrox.kernels.pdl import pdl_launch, pdl_launch_dependents, pdl_wait


@triton.jit
def _rms_norm_kernel(
    out_ptr,
    residual_out_ptr,
    x_ptr,
    residual_ptr,
    weight_ptr,
    hidden,
    eps,
    stride_x,
    stride_r,
    stride_o,
    stride_ro,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,  # launched with programmatic dependent launch (pdl.py)
):
    pdl_launch_dependents(USE_PDL)
    pdl_wait(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + row * stride_ro + cols, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, 0) / hidden + eps)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    normed = (xf * rstd).to(x_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_o + cols, (w.to(tl.float32) * normed.to(tl.float32)).to(out_ptr.dtype.element_ty), mask=mask)


def _check(x: torch.Tensor, weight: torch.Tensor) -> None:
    if x.dim() != 2 or weight.dim() != 1 or weight.shape[0] != x.shape[1]:
        raise ValueError(f"rms_norm needs x [tokens, hidden] and weight [hidden], got {tuple(x.shape)} / {tuple(weight.shape)}")
    if x.stride(-1) != 1:
        raise ValueError("rms_norm needs a contiguous hidden axis")


def _launch(x, residual, weight, eps, out, residual_out) -> None:
    hidden = x.shape[1]
    block = triton.next_power_of_2(hidden)
    _rms_norm_kernel[(x.shape[0],)](
        out,
        residual_out,
        x,
        residual,
        weight,
        hidden,
        eps,
        x.stride(0),
        residual.stride(0),
        out.stride(0),
        residual_out.stride(0),
        HAS_RESIDUAL=residual is not x,
        BLOCK=block,
        num_warps=min(16, max(1, block // 256)),
        **pdl_launch(x.device),
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of x [tokens, hidden]."""
    _check(x, weight)
    out = torch.empty_like(x)
    if x.shape[0]:
        _launch(x, x, weight, eps, out, out)
    return out


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(x + residual), x + residual) for x, residual [tokens, hidden]."""
    _check(x, weight)
    if residual.shape != x.shape or residual.dtype != x.dtype or residual.stride(-1) != 1:
        raise ValueError(f"residual must match x {tuple(x.shape)} {x.dtype}, got {tuple(residual.shape)} {residual.dtype}")
    out = torch.empty_like(x)
    residual_out = torch.empty_like(x)
    if x.shape[0]:
        _launch(x, residual, weight, eps, out, residual_out)
    return out, residual_out
