"""int8 W8A8 products: y = (xq * x_scale[:, None]) @ (w * w_scale[:, None])^T + bias, with xq int8
[M, K] (activations quantized per token or per tensor, layers/quant/int8_linear.py), w int8 [N, K]
row-major, both scales float32, y in the activation dtype.

`int8_gemm`: one Triton kernel, int8 x int8 tensor-core products accumulated exactly in int32
(|sum| <= 2^14 * K, no overflow below K = 2^17), and the epilogue fused: the int32 sums widened to
fp32, times x_scale[m] * w_scale[n], + bias, rounded once to the output dtype. float(acc) is exact
up to 2^24 and rounds to fp32 beyond (a relative 6e-8).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ferrox.kernels.tile_order import band_tile, store_tile


@triton.jit
def _scaled_tile(acc, toks, tmask, rows, rmask, x_scale_ptr, w_scale_ptr, bias_ptr, HAS_BIAS: tl.constexpr):
    """The epilogue of an int32 tile [tokens, rows]: fp32 sums times both scales, plus the bias, in
    that order (float(acc) * x_scale * w_scale, as the CPU reference computes it)."""
    y = acc.to(tl.float32) * tl.load(x_scale_ptr + toks, mask=tmask, other=0.0)[:, None]
    y = y * tl.load(w_scale_ptr + rows, mask=rmask, other=0.0)[None, :]
    if HAS_BIAS:
        y += tl.load(bias_ptr + rows, mask=rmask, other=0.0).to(tl.float32)[None, :]
    return y


@triton.jit(do_not_specialize=["M"])
def _int8_gemm_kernel(
    out_ptr,
    x_ptr,  # int8 [M, K]
    x_scale_ptr,  # float32 [M]
    w_ptr,  # int8 [N, K]
    w_scale_ptr,  # float32 [N]
    bias_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_w,
    stride_om,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    toks, tmask, rows, rmask = band_tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    cols = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + toks.to(tl.int64)[:, None] * stride_xm + cols[None, :]
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * stride_w + cols[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int32)
    for k0 in range(0, K, BLOCK_K):
        kmask = (k0 + cols) < K
        a = tl.load(x_rows + k0, mask=tmask[:, None] & kmask[None, :], other=0)
        w = tl.load(w_rows + k0, mask=rmask[:, None] & kmask[None, :], other=0)
        acc = tl.dot(a, tl.trans(w), acc, out_dtype=tl.int32)  # both K-major: the int8 MMA's layout
    y = _scaled_tile(acc, toks, tmask, rows, rmask, x_scale_ptr, w_scale_ptr, bias_ptr, HAS_BIAS)
    store_tile(out_ptr, y, toks, tmask, rows, rmask, stride_om, False)


@dataclass(frozen=True, slots=True)
class Int8GemmConfig:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    group_m: int = 8


def choose_config(m: int) -> Int8GemmConfig:
    """Tiles by batch size. Up to 16 rows (decode) the product is bound by the weight stream: thin
    16-row tiles, narrow in N so that a 4096-row weight spreads over 128+ programs, long K steps
    (H200, graph-replayed, 1-16 rows: 6.0 us at N = K = 4096, bf16's F.linear 10.1; 41-46 us at
    28672 x 4096, bf16 58; a sweep of N and K tiles and stages moved it by less than its noise).
    Prefill chunks and large batches: square tiles (1024 rows at N = K = 4096: 25 us, against 55 for
    torch._int_mm plus an epilogue launch)."""
    if m <= 16:
        return Int8GemmConfig(16, 32, 256, 4, 4)
    if m <= 64:
        return Int8GemmConfig(64, 64, 128, 4, 4)
    return Int8GemmConfig(128, 128, 128, 8, 3)


def _check(xq: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
           bias: torch.Tensor | None) -> None:
    if weight.dtype != torch.int8 or weight.dim() != 2 or weight.stride(1) != 1:
        raise ValueError(f"weight must be a row-major int8 [N, K], got {weight.dtype} {tuple(weight.shape)}")
    n, k = weight.shape
    if xq.dtype != torch.int8 or xq.dim() != 2 or xq.shape[1] != k or xq.stride(1) != 1:
        raise ValueError(f"xq must be int8 [M, {k}] with unit last stride, got {xq.dtype} {tuple(xq.shape)}")
    m = xq.shape[0]
    if x_scale.dtype != torch.float32 or x_scale.numel() != m or not x_scale.is_contiguous():
        raise ValueError(f"x_scale must be contiguous float32 with {m} values (one per row), got {x_scale.dtype} "
                         f"{tuple(x_scale.shape)}")
    if weight_scale.dtype != torch.float32 or weight_scale.shape != (n,) or weight_scale.stride(0) != 1:
        raise ValueError(f"weight_scale must be contiguous float32 [{n}], got {weight_scale.dtype} "
                         f"{tuple(weight_scale.shape)}")
    if bias is not None and (bias.shape != (n,) or bias.stride(0) != 1):
        raise ValueError(f"bias must be contiguous [{n}], got {tuple(bias.shape)}")


def int8_gemm(xq: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
              bias: torch.Tensor | None = None, out_dtype: torch.dtype = torch.bfloat16,
              config: Int8GemmConfig | None = None) -> torch.Tensor:
    """(xq * x_scale) @ (weight * weight_scale[:, None])^T (+ bias) -> [M, N] in out_dtype:
    xq int8 [M, K], x_scale float32 [M] or [M, 1], weight int8 [N, K], weight_scale float32 [N]."""
    _check(xq, x_scale, weight, weight_scale, bias)
    m, (n, k) = xq.shape[0], weight.shape
    out = torch.empty(m, n, dtype=out_dtype, device=xq.device)
    if m == 0:
        return out
    cfg = config or choose_config(m)
    grid = (triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n),)
    _int8_gemm_kernel[grid](
        out, xq, x_scale, weight, weight_scale, bias if bias is not None else weight_scale, m, n, k, xq.stride(0),
        weight.stride(0), out.stride(0), HAS_BIAS=bias is not None, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out
