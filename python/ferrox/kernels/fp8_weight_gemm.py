"""Weight-only FP8 (W8A16) products for more than one row: y = x @ (W * s)^T with W float8 E4M3
[N, K], s float32 per output row, x [M, K] in the model dtype (activations unquantized).

Why: torch has no matmul of a 16-bit input by an fp8 weight, and widening the whole weight before
F.linear costs ~15 bytes of traffic per weight (fp8 -> fp32 -> scaled -> bf16): a batched step of
an 8B W8A16 checkpoint took ~57 ms on the H200 where its one-token step takes 2.9 ms
(benches/RESULTS.md, twenty-second session).

- GEMM (decode batches, mid-size chunks, M < DEQUANT_MIN_M): each weight tile widened to the
  activation dtype in registers (every E4M3 value is exact in bf16, fp16 and fp32) and multiplied
  with tl.dot, fp32 accumulation; the row scale multiplies the sums in the epilogue, as the
  one-token GEMV (gemv.py) applies it, so batch and one-token steps round alike. From 33 rows the
  product runs swapped, y^T = W x^T (`choose_gemm_config`).
- dequantize + cuBLAS (M >= DEQUANT_MIN_M: large decode batches, prefill chunks): W written once
  in the activation dtype by one Triton pass (3 bytes per weight at ~3.4 TB/s, a fixed ~180 us
  per Llama-8B layer), then F.linear. The GEMM's widening grows with M, the pass does not: on the
  H200 (benches/bench_weight_only_gemm.py, a layer's four products) the GEMM wins at 128 rows
  (301 vs 349 us) and loses at 192 (430 vs 408) and 512 (587 vs 484), so the switch sits between.
  The scratch W lives for one product (inside a decode CUDA graph, in the graph pool).

Three GEMM tile shapes by batch size (`choose_gemm_config`): each is a compiled variant and the
engine's warm-up (worker/warmup.py) reaches them all; M is `do_not_specialize`, so a new batch
size compiles nothing while serving.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ferrox.kernels.tile_order import band_tile, dot_tile, per_row, store_tile, zero_tile

DEQUANT_MIN_M = 160  # between the measured 128 (GEMM faster) and 192 (dequantize faster)


@triton.jit(do_not_specialize=["M"])
def _fp8_weight_gemm_kernel(
    out_ptr,
    x_ptr,
    w_ptr,  # float8 E4M3 [N, K]
    w_scale_ptr,  # float32 [N]
    bias_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_w,
    stride_om,
    HAS_BIAS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 activations (no tf32 rounding); ignored for 16-bit
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,  # M tiles per band: neighbouring programs share weight tiles in L2
    SWAP_AB: tl.constexpr,  # the product as y^T = W x^T (tile_order.py; choose_gemm_config says when)
):
    toks, tmask, rows, rmask = band_tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    cols = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + toks.to(tl.int64)[:, None] * stride_xm + cols[None, :]
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * stride_w + cols[None, :]
    acc = zero_tile(BLOCK_M, BLOCK_N, SWAP_AB)
    for k0 in range(0, K, BLOCK_K):
        kmask = (k0 + cols) < K
        a = tl.load(x_rows + k0, mask=tmask[:, None] & kmask[None, :], other=0.0)
        w = tl.load(w_rows + k0, mask=rmask[:, None] & kmask[None, :], other=0.0)
        acc = dot_tile(a, w.to(a.dtype), acc, DOT_PRECISION, SWAP_AB)
    acc *= per_row(tl.load(w_scale_ptr + rows, mask=rmask, other=0.0), SWAP_AB)
    if HAS_BIAS:
        acc += per_row(tl.load(bias_ptr + rows, mask=rmask, other=0.0).to(tl.float32), SWAP_AB)
    store_tile(out_ptr, acc, toks, tmask, rows, rmask, stride_om, SWAP_AB)


@triton.jit
def _dequantize_kernel(out_ptr, w_ptr, w_scale_ptr, N, K, stride_w, stride_o, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (rows < N)[:, None] & (cols < K)[None, :]
    w = tl.load(w_ptr + rows.to(tl.int64)[:, None] * stride_w + cols[None, :], mask=mask, other=0.0)
    s = tl.load(w_scale_ptr + rows, mask=rows < N, other=0.0)
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * stride_o + cols[None, :],
             (w.to(tl.float32) * s[:, None]).to(out_ptr.dtype.element_ty), mask=mask)


@dataclass(frozen=True, slots=True)
class GemmConfig:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    group_m: int = 8
    swap_ab: bool = False  # y^T = W x^T: the widened weight tile as the MMA's register operand


def choose_gemm_config(m: int, dtype: torch.dtype = torch.bfloat16) -> GemmConfig:
    """Three tile shapes, from sweeps on the H200 (benches/RESULTS.md, twenty-second session: a layer
    of Llama-3.1-8B's four products, M 16-512): up to 32 tokens thin 32-row tiles over long K steps
    (many programs; a small batch is bound by the weight stream); beyond, the product swapped
    (y^T = W x^T, so Hopper's warpgroup MMA takes the widened weight from registers): a layer at
    64 tokens 307 -> 232 us, at 512 753 -> 594, while at 16-32 tokens the swap was slower (176 ->
    220). Square 64-tiles up to 128 tokens, 128-tiles beyond (compute-bound). Each is a compiled
    variant that the warm-up's CUDA-graph sizes reach. fp32 activations take two stages (the
    widened tiles are twice the bytes)."""
    fp32 = dtype == torch.float32
    if m <= 32:
        return GemmConfig(16, 32, 128 if fp32 else 256, 4, 2 if fp32 else 4)
    if m <= 128:
        return GemmConfig(64, 64, 64 if fp32 else 128, 4, 2 if fp32 else 4, swap_ab=True)
    return GemmConfig(128, 128, 64, 8, 2 if fp32 else 3, swap_ab=True)


def _check(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None) -> None:
    # int8 weights (layers/quant/int8_linear.py, weight-only) widen exactly too: the same kernels.
    if weight.dtype not in (torch.float8_e4m3fn, torch.int8) or weight.dim() != 2 or weight.stride(1) != 1:
        raise ValueError(f"weight must be a row-major float8_e4m3fn (or int8) [N, K], got {weight.dtype} "
                         f"{tuple(weight.shape)}")
    n, k = weight.shape
    if x.dim() != 2 or x.shape[1] != k or x.stride(1) != 1:
        raise ValueError(f"x must be [M, {k}] with unit last stride, got {tuple(x.shape)} (strides {x.stride()})")
    if weight_scale.dtype != torch.float32 or weight_scale.shape != (n,) or weight_scale.stride(0) != 1:
        raise ValueError(f"weight_scale must be contiguous float32 [{n}], got {weight_scale.dtype} "
                         f"{tuple(weight_scale.shape)}")
    if bias is not None and (bias.shape != (n,) or bias.stride(0) != 1):
        raise ValueError(f"bias must be contiguous [{n}], got {tuple(bias.shape)}")


def fp8_weight_gemm(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                    bias: torch.Tensor | None = None, config: GemmConfig | None = None) -> torch.Tensor:
    """x [M, K] @ (weight * weight_scale[:, None])^T (+ bias) -> [M, N] in x's dtype, the weight
    widened tile by tile in registers."""
    _check(x, weight, weight_scale, bias)
    m, (n, k) = x.shape[0], weight.shape
    cfg = config or choose_gemm_config(m, x.dtype)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n),)
    _fp8_weight_gemm_kernel[grid](
        out, x, weight, weight_scale, bias if bias is not None else weight_scale, m, n, k, x.stride(0),
        weight.stride(0), out.stride(0), HAS_BIAS=bias is not None,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32", BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m, SWAP_AB=cfg.swap_ab, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return out


def fp8_dequantize(weight: torch.Tensor, weight_scale: torch.Tensor, dtype: torch.dtype, *, block_n: int = 16,
                   block_k: int = 1024, num_warps: int = 4) -> torch.Tensor:
    """weight * weight_scale[:, None] in `dtype` (computed in fp32, rounded once), one pass; a
    program writes block_n rows of block_k columns."""
    n, k = weight.shape
    out = torch.empty(n, k, dtype=dtype, device=weight.device)
    _dequantize_kernel[(triton.cdiv(n, block_n), triton.cdiv(k, block_k))](
        out, weight, weight_scale, n, k, weight.stride(0), out.stride(0), BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=num_warps)
    return out


def fp8_weight_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                      bias: torch.Tensor | None = None) -> torch.Tensor:
    """The W8A16 product for M > 1 rows (x [M, K], unit last stride): the GEMM below
    DEQUANT_MIN_M rows, dequantize + cuBLAS from there (module docstring)."""
    if x.shape[0] < DEQUANT_MIN_M:
        return fp8_weight_gemm(x, weight, weight_scale, bias)
    return F.linear(x, fp8_dequantize(weight, weight_scale, x.dtype), bias)
