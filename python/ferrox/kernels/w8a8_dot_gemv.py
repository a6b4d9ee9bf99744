"""W8A8 one-token products on tensor cores, split over K: y = W @ x for one token, W float8 E4M3 or
int8 [N, K] with per-row scales, x quantized to the weight's format with one per-token scale (as the
batched paths quantize it: torch._scaled_mm for FP8, kernels/int8_gemm.py for int8, and vLLM's W8A8
linear layers at every batch size).

Why not gemv.py's CUDA-core loop: there every weight byte is widened (e4m3 -> f16 -> f32, int8 ->
f32) before its FMA, and the H200's conversion rate, not its memory, bounds the stream (~2-3 TB/s,
benches/RESULTS.md). An E4M3 x E4M3 or s8 x s8 MMA takes the bytes as they are. The token is the MMA's
narrow side, broadcast over its 16 columns ("swap AB": the weight rows are the wide side, so a
program owns BLOCK_N rows and nothing is padded on the side that is read from memory); all 16
columns then hold the same sums: FP8 takes their sum over 16 (exact: a tree of equal fp32 values),
int8 the first column (sixteen int32 sums could overflow).

Hopper's FP8 MMAs (wgmma, from 64 rows per program) keep only part of each product's mantissa in
the accumulator unless told otherwise (~1e-3 relative at K = 4096, measured); a change that small
still moves the next layer's fp8 input codes across rounding boundaries, so the one-token path
would drift from the batched one. max_num_imprecise_acc=0 makes Triton add each MMA's result into
fp32 registers: exact sums, at a few adds per accumulator per K tile (the stream is memory-bound).
int8 MMAs accumulate in int32, exactly; the split-K partials stay int32 too, so the row sum that
reaches the epilogue is the int8 GEMM's to the bit. Block-wise FP8 (`block`) keeps exact group sums
here too, while the batched block GEMM lets the MMA accumulate each group (fp8_block_gemm.py says
why), so a token's one-row and batched products differ by that accumulator's rounding.

With 64-128 rows per program the narrow projections have too few programs for 132 SMs, so K is
split and the last-arriving program of each row block finishes the sum (split_k.py).

Prologue: each program reads the whole input from L2 (a few KB) for the RMS statistic (NORM) and
then the normed input's per-token scale (its absmax / 448 or / 127; a static input scale, from
checkpoints with static activations, as is). Each K tile of the input is then normed and quantized
with the roundings of the unfused path (rmsnorm.py, then fp8_linear.py's quantizer), so the fused
and unfused one-token steps agree to the code; that costs a few operations per input element, not
per weight.

Epilogue: the row sums in fp32 times the input and weight scales (in that order, as the int8 GEMM),
then gemv.py's `_store_rows` (bias, SiLU(gate) * up, residual, the roundings of the unfused path).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ferrox.kernels import dense_gemv_cuda
from ferrox.kernels.gemv import (
    _check_input,
    _check_output,
    _fp8_code,
    _normed_input,
    _rms_rstd,
    _store_rows,
    _token_stats,
    token_stats_block,
)
from ferrox.kernels.int8_codes import int8_code
from ferrox.kernels.split_k import _merge_split_k, num_sms, split_buffers, split_for


@triton.jit
def _epilogue(out_ptr, x_ptr, bias_ptr, res_ptr, w_scale_ptr, y, up, x_scale, rows, rmask, n_out,
              HAS_BIAS: tl.constexpr, SILU_MUL: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
              BLOCK_SCALES: tl.constexpr):
    if not BLOCK_SCALES:  # (block scales were applied group by group in the K loop)
        y = y.to(tl.float32) * x_scale * tl.load(w_scale_ptr + rows, mask=rmask, other=0.0)
        if SILU_MUL:
            up = up.to(tl.float32) * x_scale * tl.load(w_scale_ptr + n_out + rows, mask=rmask, other=0.0)
    _store_rows(out_ptr, x_ptr, bias_ptr, res_ptr, y, up, rows, rmask, n_out, HAS_BIAS, SILU_MUL, HAS_RESIDUAL)


@triton.jit
def _w8a8_dot_gemv_kernel(
    out_ptr,
    w_ptr,  # float8 E4M3 or int8 [2 n_out (SILU_MUL) or n_out, K]
    w_scale_ptr,  # float32 per row; with BLOCK_SCALES [rows / BN, K / BLOCK_K] (a row stride_ws apart)
    bias_ptr,
    x_ptr,  # [1, K] in the activation dtype
    res_ptr,
    norm_w_ptr,
    in_scale_ptr,  # float32 [1] (STATIC)
    part_ptr,  # float32 (int32 with INT8) [SPLIT, 2, n_out] partial sums (SPLIT > 1)
    count_ptr,  # int32 per row block, zero between launches (SPLIT > 1)
    eps,
    n_out,
    K,
    k_per_split,  # a multiple of BLOCK_K
    stride_w,
    stride_ws,
    NORM: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SILU_MUL: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    STATIC: tl.constexpr,
    INT8: tl.constexpr,  # int8 weight and codes, int32 sums (else E4M3, fp32 sums)
    BLOCK_SCALES: tl.constexpr,  # block-wise FP8: a weight scale per BN rows x BLOCK_K, a token scale per group
    BN: tl.constexpr,
    SPLIT: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_X: tl.constexpr,  # the prologue's tile
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    if BLOCK_SCALES:  # (each K tile is a group with its own scale, taken in the loop)
        rstd = _rms_rstd(x_ptr, K, eps, NORM, BLOCK_X)
        x_scale = 1.0
    else:
        rstd, x_scale = _token_stats(x_ptr, norm_w_ptr, in_scale_ptr, K, eps, NORM, STATIC, INT8, BLOCK_X)

    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < n_out
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * stride_w
    if INT8:
        acc = tl.zeros([BLOCK_N, 16], dtype=tl.int32)
        acc_up = tl.zeros([BLOCK_N, 16], dtype=tl.int32)
    else:
        acc = tl.zeros([BLOCK_N, 16], dtype=tl.float32)
        acc_up = tl.zeros([BLOCK_N, 16], dtype=tl.float32)
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        kmask = cols < k_hi
        xn = _normed_input(x_ptr, norm_w_ptr, cols, kmask, rstd, NORM)
        if INT8:
            code = int8_code(xn, x_scale).to(tl.int8)
        elif BLOCK_SCALES:  # this group's scale, as fp8_block_gemm.py's quantizer divides
            g_scale = tl.math.div_rn(tl.maximum(tl.max(tl.abs(xn)), 1e-12), 448.0)
            code = tl.clamp(tl.math.div_rn(xn, g_scale), -448.0, 448.0).to(tl.float8e4nv)
        else:
            code = _fp8_code(xn, x_scale)
        xb = tl.broadcast_to(code[:, None], (BLOCK_K, 16))
        wmask = rmask[:, None] & kmask[None, :]
        w = tl.load(w_rows + cols[None, :], mask=wmask, other=0.0, eviction_policy="evict_first")
        if SILU_MUL:
            w_up = tl.load(w_rows + n_out * stride_w + cols[None, :], mask=wmask, other=0.0,
                           eviction_policy="evict_first")
        if INT8:
            acc = tl.dot(w, xb, acc, out_dtype=tl.int32)
            if SILU_MUL:
                acc_up = tl.dot(w_up, xb, acc_up, out_dtype=tl.int32)
        elif BLOCK_SCALES:  # the group's fp32 partial sum times its two scales, as the block GEMM adds it
            group = k0 // BLOCK_K
            w_scale = tl.load(w_scale_ptr + (rows // BN) * stride_ws + group, mask=rmask, other=0.0)
            acc += tl.dot(w, xb, max_num_imprecise_acc=0) * g_scale * w_scale[:, None]
            if SILU_MUL:
                w_scale_up = tl.load(w_scale_ptr + ((n_out + rows) // BN) * stride_ws + group, mask=rmask, other=0.0)
                acc_up += tl.dot(w_up, xb, max_num_imprecise_acc=0) * g_scale * w_scale_up[:, None]
        else:
            acc = tl.dot(w, xb, acc, max_num_imprecise_acc=0)  # exact fp32 sums (module docstring)
            if SILU_MUL:
                acc_up = tl.dot(w_up, xb, acc_up, max_num_imprecise_acc=0)
    # Every column holds the same sums (the token broadcast; module docstring).
    if INT8:
        first = tl.arange(0, 16)[None, :] == 0
        y = tl.sum(tl.where(first, acc, 0), axis=1)
        up = tl.sum(tl.where(first, acc_up, 0), axis=1)
    else:
        y = tl.sum(acc, axis=1) / 16.0
        up = tl.sum(acc_up, axis=1) / 16.0

    if SPLIT > 1:
        last, y, up = _merge_split_k(part_ptr, count_ptr, y, up, rows, rmask, n_out, pid_n, pid_k, SPLIT, SILU_MUL)
        if last:
            _epilogue(out_ptr, x_ptr, bias_ptr, res_ptr, w_scale_ptr, y, up, x_scale, rows, rmask, n_out,
                      HAS_BIAS, SILU_MUL, HAS_RESIDUAL, BLOCK_SCALES)
    else:
        _epilogue(out_ptr, x_ptr, bias_ptr, res_ptr, w_scale_ptr, y, up, x_scale, rows, rmask, n_out,
                  HAS_BIAS, SILU_MUL, HAS_RESIDUAL, BLOCK_SCALES)


@dataclass(frozen=True, slots=True)
class DotGemvConfig:
    block_n: int  # weight rows per program (the MMA's wide side)
    block_k: int
    split: int  # K ranges, each finished by its own program
    num_warps: int
    num_stages: int = 3


def choose_dot_config(n_out: int, k: int, num_sms: int) -> DotGemvConfig:
    """From `bench_fp8.py --sweep-dot` on an H200 (benches/RESULTS.md): wide products with a row block
    of 64 per SM or more (gate_up) run unsplit, 64 rows x 256 K per tile (a split only adds partial
    sums); narrow ones (o_proj, down: N = 4096) take 128 rows x 128 K and split K until about two
    programs run per SM, each range kept at least 512 wide."""
    if triton.cdiv(n_out, 64) >= num_sms:
        return DotGemvConfig(64, 256, 1, 4)
    return DotGemvConfig(128, 128, split_for(triton.cdiv(n_out, 128), k, num_sms, min_range=512), 4)


def w8a8_dot_gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    silu_mul: bool = False,
    residual: torch.Tensor | None = None,
    input_scale: torch.Tensor | None = None,
    block: tuple[int, int] | None = None,
    out_dtype: torch.dtype | None = None,
    config: DotGemvConfig | None = None,
) -> torch.Tensor:
    """gemv.gemv's contract for an fp8 or int8 weight (y = W @ rms_norm(x) (+ bias) [-> silu(gate) *
    up] [+ residual], x [1, K]), with x quantized to the weight's format per token (or by the static
    `input_scale`, float32 [1]) and the product on tensor cores. Returns y [1, N] (N / 2 with
    silu_mul). block = (BN, BK): a block-wise FP8 weight (layers/quant/fp8_block.py), weight_scale
    float32 [ceil(N / BN), ceil(K / BK)], x quantized per group of BK inputs (fp8_block_gemm.py's
    arithmetic; the K tile is the group)."""
    if weight.dtype not in (torch.float8_e4m3fn, torch.int8):
        raise ValueError(f"w8a8_dot_gemv needs a float8_e4m3fn or int8 weight, got {weight.dtype}")
    if block is not None:
        _check_block_scales(weight, weight_scale, block, input_scale)
        k = _check_input(x, weight, norm_weight, row_scales=False)
    else:
        k = _check_input(x, weight, norm_weight, weight_scale)
    n_out = _check_output(weight, silu_mul, residual)
    if input_scale is not None and (input_scale.dtype != torch.float32 or input_scale.numel() != 1):
        raise ValueError(f"input_scale must be one float32 value, got {input_scale.dtype} {tuple(input_scale.shape)}")
    # FP8 on a GPU with FP8 mma.sync, per-row scales or 128-input groups: dense_gemv_cuda.py's kernel (16 rows
    # a block, no split).
    if (config is None and x.is_cuda
            and dense_gemv_cuda.supported(x, weight, weight_scale=weight_scale, bias=bias, norm_weight=norm_weight,
                                          residual=residual, silu_mul=silu_mul, input_scale=input_scale,
                                          out_dtype=out_dtype, block=block)):
        return dense_gemv_cuda.dense_mma_product(x, weight, bias, weight_scale=weight_scale, norm_weight=norm_weight,
                                                 eps=eps, silu_mul=silu_mul, residual=residual,
                                                 input_scale=input_scale, out_dtype=out_dtype, block=block)
    cfg = config or choose_dot_config(n_out, k, num_sms(x.device))
    if block is not None and config is None and cfg.split > 1:
        # Block scales, narrow products: 64 rows x 8 K ranges measured best on an H200 (o_proj 11.1 ->
        # 10.4 us, down 28.0 -> 25.5; qkv within noise: benches/RESULTS.md, twenty-fifth session).
        cfg = DotGemvConfig(64, block[1], 8, 4)
    if block is not None:  # the K tile is the group; a split must start on one
        cfg = dataclasses.replace(cfg, block_k=block[1])
    k_per_split = triton.cdiv(triton.cdiv(k, cfg.split), cfg.block_k) * cfg.block_k
    split = triton.cdiv(k, k_per_split)
    blocks = triton.cdiv(n_out, cfg.block_n)
    out = torch.empty(1, n_out, dtype=out_dtype or x.dtype, device=x.device)
    int8 = weight.dtype == torch.int8
    part, counts = split_buffers(split, blocks, n_out, out, torch.int32 if int8 else torch.float32)
    _w8a8_dot_gemv_kernel[(blocks, split)](
        out, weight, weight_scale, bias if bias is not None else weight, x,
        residual if residual is not None else x, norm_weight if norm_weight is not None else x,
        input_scale if input_scale is not None else weight_scale, part, counts, eps, n_out, k, k_per_split,
        weight.stride(0), weight_scale.stride(0), NORM=norm_weight is not None, HAS_BIAS=bias is not None,
        SILU_MUL=silu_mul, HAS_RESIDUAL=residual is not None, STATIC=input_scale is not None, INT8=int8,
        BLOCK_SCALES=block is not None, BN=block[0] if block is not None else 1, SPLIT=split, BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k, BLOCK_X=token_stats_block(k), num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return out


def _check_block_scales(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
                        input_scale: torch.Tensor | None) -> None:
    bn, bk = block
    if weight.dtype != torch.float8_e4m3fn or input_scale is not None:
        raise ValueError("block scales go with a float8_e4m3fn weight and dynamic (per group) activations")
    if bn < 16 or bk < 32 or bn & (bn - 1) or bk & (bk - 1):  # (an FP8 MMA's K is 32 or more)
        raise ValueError(f"block must be powers of two, from 16 rows and 32 columns, got {block}")
    blocks = (triton.cdiv(weight.shape[0], bn), triton.cdiv(weight.shape[1], bk))
    if scale.dtype != torch.float32 or tuple(scale.shape) != blocks or scale.stride(1) != 1:
        raise ValueError(f"block scales must be float32 {list(blocks)} with unit column stride, got {scale.dtype} "
                         f"{tuple(scale.shape)}")
