"""Matrix-vector products for one-token decode steps, with the small ops around them fused in.

A batch-1 decode step of an 8B model is ~15 GB of weight reads spread over 4 projections per
layer; everything else (RMSNorm, residual add, rotary, KV write, SiLU) is tiny, but as separate
kernels it costs ~10 launches per layer, i.e. ~0.6 ms of an ~4.7 ms step on an H200 (issue 5).
Every program of a matrix-vector product reads the whole input vector anyway (a few KB, from L2),
so RMSNorm, which needs the whole vector, can run in its prologue; the ops that need only the
program's own outputs -- the residual add, SiLU(gate) * up, rotary, the KV-cache write -- run in
its epilogue. A decoder layer then runs five launches: norm+qkv+rotary+KV write, attention,
o_proj+residual, norm+gate_up+SiLU, down_proj+residual, and the residual stream h is always a
complete vector between them (no "x + residual" pending for the next norm).

Layout: weight [N, K] row-major (nn.Linear's). One program computes BLOCK_N outputs over the
full K (no split-K, so no second reduction launch), streaming its weight rows once
(evict_first: they are not read again this step) and accumulating elementwise in fp32; the row
sums happen once, after the loop.

RMSNorm in one pass: out = W @ (g * h) * rsqrt(mean(h^2) + eps) -- the sum of squares of h is
accumulated in the same loop as the products and applied at the end, so no program waits for
the statistic before streaming weights. (The unfused path rounds the normed vector to the
activation dtype before the matmul; this path does not, a difference well inside bf16 noise.)

FP8 weights (layers/quant/fp8.py): the weight may be float8 E4M3 with one float32 scale per row
(`weight_scale`, HAS_W_SCALE). The input stays in the activation dtype (weight-only: no activation
quantization at one token), each weight byte is streamed once and widened in registers, and the
row's scale multiplies its sum in the epilogue, before bias, SiLU, residual and rotary. Roundings
"to the activation dtype" use the input's dtype, which is the weight's on the float path.

int4 weights (AWQ / GPTQ) take the same prologue and epilogue in the int4 GEMV (int4_matmul.py,
flags of `_int4_gemv_kernel` sharing `_input_tile` and `_store_rows` from here); it has no rotary
epilogue, so their qkv projection is followed by qk_norm_rope.py's rotary + KV-write launch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ferrox.kernels import dense_gemv_cuda
from ferrox.kernels.int8_codes import int8_code, int8_scale
from ferrox.kernels.kv_fp8 import unit_kv_scales
from ferrox.kernels.pdl import pdl_launch, pdl_launch_dependents, pdl_wait
from ferrox.kernels.reshape_and_cache import store_head_kv


@triton.jit
def _input_tile(x_ptr, norm_w_ptr, cols, kmask, NORM: tl.constexpr):
    """The K-tile `cols` of the matmul input in fp32 -- times the norm weight with NORM -- and
    the raw tile (for the RMS statistic)."""
    h = tl.load(x_ptr + cols, mask=kmask, other=0.0).to(tl.float32)
    xin = h
    if NORM:
        xin = h * tl.load(norm_w_ptr + cols, mask=kmask, other=0.0).to(tl.float32)
    return xin, h


@triton.jit
def _store_rows(out_ptr, x_ptr, bias_ptr, res_ptr, y, up, rows, rmask, n_out, HAS_BIAS: tl.constexpr,
               SILU_MUL: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
    """The one-token GEMVs' epilogue (this module's and the int4 one, int4_matmul.py): y (and up,
    with SILU_MUL: the up rows n_out further on) are fp32 row sums with the norm and weight scales
    applied; add the bias, take silu(gate) * up, add the residual, store `rows` of out. Roundings
    to the activation dtype use x's dtype."""
    if HAS_BIAS:
        y += tl.load(bias_ptr + rows, mask=rmask, other=0.0).to(tl.float32)
    if SILU_MUL:
        if HAS_BIAS:
            up += tl.load(bias_ptr + n_out + rows, mask=rmask, other=0.0).to(tl.float32)
        # Round gate and up to the activation dtype first, as the unfused path stores them.
        gate = y.to(x_ptr.dtype.element_ty).to(tl.float32)
        up = up.to(x_ptr.dtype.element_ty).to(tl.float32)
        y = gate / (1.0 + tl.exp(-gate)) * up
    if HAS_RESIDUAL:
        # The projection output in its dtype, then the add (rounded once more): bit-equal to the
        # unfused linear + fused_add_rms_norm residual stream.
        y = y.to(out_ptr.dtype.element_ty).to(tl.float32)
        y += tl.load(res_ptr + rows, mask=rmask, other=0.0).to(tl.float32)
    tl.store(out_ptr + rows, y.to(out_ptr.dtype.element_ty), mask=rmask)


@triton.jit
def _norm_tile(h, g, rstd, NORM: tl.constexpr):
    """A loaded input tile h (and norm weight tile g) as the unfused path hands it to the activation
    quantizer, in fp32: with NORM, rmsnorm.py's g * round(h * rstd), rounded to h's dtype again."""
    if NORM:
        normed = (h.to(tl.float32) * rstd).to(h.dtype)
        h = (g.to(tl.float32) * normed.to(tl.float32)).to(h.dtype)
    return h.to(tl.float32)


@triton.jit
def _normed_input(x_ptr, norm_w_ptr, cols, kmask, rstd, NORM: tl.constexpr):
    """The W8A8 kernels' input tile (w8a8_dot_gemv.py, the qkv kernel here): `_norm_tile` of the
    K-tile `cols`."""
    h = tl.load(x_ptr + cols, mask=kmask, other=0.0)
    g = h
    if NORM:
        g = tl.load(norm_w_ptr + cols, mask=kmask, other=0.0)
    return _norm_tile(h, g, rstd, NORM)


@triton.jit
def _rms_rstd(x_ptr, K, eps, NORM: tl.constexpr, BLOCK: tl.constexpr):
    """The RMSNorm statistic rsqrt(mean(x^2) + eps) of the token x [K] (1 without NORM), read from
    L2 by every program of a tensor-core one-token product before its first tile."""
    rstd = 1.0
    if NORM:
        ssq = tl.zeros([BLOCK], dtype=tl.float32)
        for k0 in range(0, K, BLOCK):
            cols = k0 + tl.arange(0, BLOCK)
            h = tl.load(x_ptr + cols, mask=cols < K, other=0.0).to(tl.float32)
            ssq += h * h
        rstd = tl.rsqrt(tl.sum(ssq) / K + eps)
    return rstd


@triton.jit
def _token_stats(x_ptr, norm_w_ptr, in_scale_ptr, K, eps, NORM: tl.constexpr, STATIC: tl.constexpr,
                 INT8: tl.constexpr, BLOCK: tl.constexpr):
    """(rstd, the fp8 or int8 scale of the normed input) for the W8A8 kernels' prologue: the RMSNorm
    statistic (1 without NORM), then the scale as fp8_linear.py's activation quantizer takes it
    (the token's absmax / 448, or / 127 with INT8; or the static input scale). Every program pays
    this before its first MMA, so a token that fits one BLOCK is read once (one L2 round trip for
    both); a longer one in two passes of BLOCK tiles."""
    if STATIC:
        return _rms_rstd(x_ptr, K, eps, NORM, BLOCK), tl.load(in_scale_ptr)
    if K <= BLOCK:
        cols = tl.arange(0, BLOCK)
        kmask = cols < K
        h = tl.load(x_ptr + cols, mask=kmask, other=0.0)
        g = h
        rstd = 1.0
        if NORM:
            g = tl.load(norm_w_ptr + cols, mask=kmask, other=0.0)
            hf = h.to(tl.float32)
            rstd = tl.rsqrt(tl.sum(hf * hf) / K + eps)
        amax = tl.max(tl.abs(_norm_tile(h, g, rstd, NORM)))
    else:
        rstd = _rms_rstd(x_ptr, K, eps, NORM, BLOCK)
        amax_tile = tl.zeros([BLOCK], dtype=tl.float32)
        for k0 in range(0, K, BLOCK):
            cols = k0 + tl.arange(0, BLOCK)
            amax_tile = tl.maximum(amax_tile, tl.abs(_normed_input(x_ptr, norm_w_ptr, cols, cols < K, rstd, NORM)))
        amax = tl.max(amax_tile)
    if INT8:
        x_scale = int8_scale(amax, 1e-12)
    else:
        x_scale = tl.maximum(amax, 1e-12) / 448.0
    return rstd, x_scale


@triton.jit
def _fp8_code(xn, x_scale):
    """A normed input tile in E4M3 at the token's scale, saturating as the quantizer does."""
    return tl.clamp(xn / x_scale, -448.0, 448.0).to(tl.float8e4nv)


def token_stats_block(k: int) -> int:
    """`_token_stats`'s tile for an input of k: up to 4096 wide, so Llama-3.1-8B's 4096-wide token
    is read once (was: eight dependent 1024-wide reads for norm + scale) and its 14,336-wide MLP
    input in four tiles a pass (was: fourteen). Registers: the tile lives only in the prologue,
    before the accumulators (benches/sass_loop.py: the same registers as 1024-wide tiles)."""
    return min(4096, triton.next_power_of_2(k))


@triton.jit
def _paired_row_sums(acc_a, acc_b, sq, K, eps, NORM: tl.constexpr):
    """The row sums of two [rows, BLOCK_K] accumulators that share an input, each times the
    one-pass RMSNorm's rsqrt(mean(h^2) + eps) with NORM (sq: the h^2 accumulated beside them)."""
    a = tl.sum(acc_a, axis=1)
    b = tl.sum(acc_b, axis=1)
    if NORM:
        rstd = tl.rsqrt(tl.sum(sq, axis=0) / K + eps)
        a, b = a * rstd, b * rstd
    return a, b


@triton.jit
def _weight_tile(w_rows, cols, rmask, kmask, up_offset, SILU_MUL: tl.constexpr):
    """The K-tile `cols` of the program's weight rows (and of its up rows, `up_offset` further on,
    with SILU_MUL; otherwise the gate tile again), streamed once (evict_first)."""
    wmask = rmask[:, None] & kmask[None, :]
    w = tl.load(w_rows + cols[None, :], mask=wmask, other=0.0, eviction_policy="evict_first")
    w_up = w
    if SILU_MUL:
        w_up = tl.load(w_rows + up_offset + cols[None, :], mask=wmask, other=0.0, eviction_policy="evict_first")
    return w, w_up


@triton.jit
def _accumulate(acc, acc_up, sq, w, w_up, x_ptr, norm_w_ptr, cols, kmask, NORM: tl.constexpr,
                SILU_MUL: tl.constexpr):
    """Add one K tile's products to the fp32 accumulators (and h^2 for the one-pass RMSNorm)."""
    xin, h = _input_tile(x_ptr, norm_w_ptr, cols, kmask, NORM)
    acc += w.to(tl.float32) * xin[None, :]
    if SILU_MUL:
        acc_up += w_up.to(tl.float32) * xin[None, :]
    if NORM:
        sq += h * h
    return acc, acc_up, sq


@triton.jit
def _gemv_kernel(
    out_ptr,
    w_ptr,
    w_scale_ptr,  # float32 [N] per-row weight scales (HAS_W_SCALE: an fp8 weight)
    bias_ptr,
    x_ptr,
    res_ptr,
    norm_w_ptr,
    eps,
    n_out,
    K,
    stride_w,
    NORM: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SILU_MUL: tl.constexpr,  # rows [0, n_out) are gate, [n_out, 2 n_out) up: out = silu(gate) * up
    HAS_RESIDUAL: tl.constexpr,  # out = (W @ x) + residual, each rounded as the unfused ops round
    HAS_W_SCALE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr,  # launched with programmatic dependent launch (pdl.py)
):
    pdl_launch_dependents(USE_PDL)
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < n_out
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * stride_w
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    sq = tl.zeros([BLOCK_K], dtype=tl.float32)
    # The first weight tile is requested before waiting for the previous kernel (pdl.py).
    cols = tl.arange(0, BLOCK_K)
    kmask = cols < K
    w, w_up = _weight_tile(w_rows, cols, rmask, kmask, n_out * stride_w, SILU_MUL)
    pdl_wait(USE_PDL)
    acc, acc_up, sq = _accumulate(acc, acc_up, sq, w, w_up, x_ptr, norm_w_ptr, cols, kmask, NORM, SILU_MUL)
    for k0 in range(BLOCK_K, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        kmask = cols < K
        w, w_up = _weight_tile(w_rows, cols, rmask, kmask, n_out * stride_w, SILU_MUL)
        acc, acc_up, sq = _accumulate(acc, acc_up, sq, w, w_up, x_ptr, norm_w_ptr, cols, kmask, NORM, SILU_MUL)
    y = tl.sum(acc, axis=1)
    up = y  # (the up rows' sums with SILU_MUL)
    if NORM:
        rstd = tl.rsqrt(tl.sum(sq, axis=0) / K + eps)
        y = y * rstd
    if HAS_W_SCALE:
        y = y * tl.load(w_scale_ptr + rows, mask=rmask, other=0.0)
    if SILU_MUL:
        up = tl.sum(acc_up, axis=1)
        if NORM:
            up = up * rstd
        if HAS_W_SCALE:
            up = up * tl.load(w_scale_ptr + n_out + rows, mask=rmask, other=0.0)
    _store_rows(out_ptr, x_ptr, bias_ptr, res_ptr, y, up, rows, rmask, n_out, HAS_BIAS, SILU_MUL, HAS_RESIDUAL)


@triton.jit
def _pair_tiles(w_lo, w_hi, cols, kmask):
    """The K-tile `cols` of a program's two row sets (the halves of its rotary pairs)."""
    wl = tl.load(w_lo + cols[None, :], mask=kmask[None, :], other=0.0, eviction_policy="evict_first")
    wh = tl.load(w_hi + cols[None, :], mask=kmask[None, :], other=0.0, eviction_policy="evict_first")
    return wl, wh


@triton.jit
def _qkv_rope_kernel(
    q_out_ptr,
    cache_ptr,
    w_ptr,
    w_scale_ptr,  # float32 [rows] per-row weight scales (HAS_W_SCALE: an fp8 weight)
    bias_ptr,
    x_ptr,
    norm_w_ptr,
    eps,
    rope_ptr,  # this token's [cos | sin] row, float32, HALF each
    slot_ptr,
    kv_scale_ptr,  # float32 (k_scale, v_scale) of an FP8 cache (attention/kv_cache.py)
    in_scale_ptr,  # float32 [1]: the static input scale (W8A8 and STATIC)
    K,
    stride_w,
    num_q_heads,
    num_kv_heads,
    block_size,
    stride_ckv,
    stride_cblock,
    stride_cslot,
    stride_chead,
    HEAD_DIM: tl.constexpr,
    NORM: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_W_SCALE: tl.constexpr,
    W8A8: tl.constexpr,  # the input rounded through fp8 first, as the layer's other kernels take it
    STATIC: tl.constexpr,
    INT8: tl.constexpr,  # W8A8 with an int8 weight: int8 codes, int32 sums (exact, as the int8 GEMM's)
    BLOCK_P: tl.constexpr,  # rotary pairs (d, d + HEAD_DIM / 2) per program
    BLOCK_K: tl.constexpr,
    BLOCK_X: tl.constexpr,  # W8A8: the token statistics' tile (token_stats_block)
    USE_PDL: tl.constexpr,  # launched with programmatic dependent launch (pdl.py)
):
    """One program: BLOCK_P rotary pairs of one head of the merged q/k/v projection. Its two row
    sets are the pair's halves, so the epilogue can rotate q and k and store k and v straight
    into the paged cache at this token's slot (no separate rotary or KV-write launch).

    It never lets its dependents launch early (no `pdl_launch_dependents`, pdl.py says why): the
    attention kernel after it starts as its programs exit."""
    HALF: tl.constexpr = HEAD_DIM // 2
    pid = tl.program_id(0)
    head = pid // (HALF // BLOCK_P)
    pairs = (pid % (HALF // BLOCK_P)) * BLOCK_P + tl.arange(0, BLOCK_P)
    rows = head * HEAD_DIM + pairs
    w_lo = w_ptr + rows.to(tl.int64)[:, None] * stride_w
    w_hi = w_lo + HALF * stride_w
    if INT8:
        acc_lo = tl.zeros([BLOCK_P, BLOCK_K], dtype=tl.int32)
        acc_hi = tl.zeros([BLOCK_P, BLOCK_K], dtype=tl.int32)
    else:
        acc_lo = tl.zeros([BLOCK_P, BLOCK_K], dtype=tl.float32)
        acc_hi = tl.zeros([BLOCK_P, BLOCK_K], dtype=tl.float32)
    sq = tl.zeros([BLOCK_K], dtype=tl.float32)
    # The first weight tiles are requested before waiting for the previous kernel (pdl.py).
    cols = tl.arange(0, BLOCK_K)
    wl, wh = _pair_tiles(w_lo, w_hi, cols, cols < K)
    pdl_wait(USE_PDL)
    rstd, x_scale = 1.0, 1.0
    if W8A8:
        rstd, x_scale = _token_stats(x_ptr, norm_w_ptr, in_scale_ptr, K, eps, NORM, STATIC, INT8, BLOCK_X)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        kmask = cols < K
        if k0 > 0:
            wl, wh = _pair_tiles(w_lo, w_hi, cols, kmask)
        if INT8:  # int8 products summed in int32 (sign-extending a byte is cheaper than widening it to fp32)
            xq = int8_code(_normed_input(x_ptr, norm_w_ptr, cols, kmask, rstd, NORM), x_scale).to(tl.int32)
            acc_lo += wl.to(tl.int32) * xq[None, :]
            acc_hi += wh.to(tl.int32) * xq[None, :]
        else:
            if W8A8:  # the value of the input's fp8 code (its scale applies to the row sums)
                xin = _fp8_code(_normed_input(x_ptr, norm_w_ptr, cols, kmask, rstd, NORM), x_scale).to(tl.float32)
            else:
                xin, h = _input_tile(x_ptr, norm_w_ptr, cols, kmask, NORM)
                if NORM:
                    sq += h * h
            acc_lo += wl.to(tl.float32) * xin[None, :]
            acc_hi += wh.to(tl.float32) * xin[None, :]
    if W8A8:  # the norm's rstd is in the codes already
        lo, hi = _paired_row_sums(acc_lo, acc_hi, sq, K, eps, False)
        lo, hi = lo.to(tl.float32) * x_scale, hi.to(tl.float32) * x_scale
    else:
        lo, hi = _paired_row_sums(acc_lo, acc_hi, sq, K, eps, NORM)
    if HAS_W_SCALE:
        lo = lo * tl.load(w_scale_ptr + rows)
        hi = hi * tl.load(w_scale_ptr + rows + HALF)
    if HAS_BIAS:
        lo += tl.load(bias_ptr + rows).to(tl.float32)
        hi += tl.load(bias_ptr + rows + HALF).to(tl.float32)
    # The projection's output in the activation dtype, as the unfused path would store it.
    lo = lo.to(x_ptr.dtype.element_ty).to(tl.float32)
    hi = hi.to(x_ptr.dtype.element_ty).to(tl.float32)

    is_v = head >= num_q_heads + num_kv_heads
    cos = tl.load(rope_ptr + pairs)
    sin = tl.load(rope_ptr + HALF + pairs)
    cos = tl.where(is_v, 1.0, cos)  # v is not rotated
    sin = tl.where(is_v, 0.0, sin)
    out_lo = (lo * cos - hi * sin).to(q_out_ptr.dtype.element_ty)
    out_hi = (hi * cos + lo * sin).to(q_out_ptr.dtype.element_ty)

    # Scalar conditions become row limits (a block mask must come from a block comparison).
    q_mask = pairs < tl.where(head < num_q_heads, HALF, 0)
    tl.store(q_out_ptr + rows, out_lo, mask=q_mask)
    tl.store(q_out_ptr + rows + HALF, out_hi, mask=q_mask)

    store_head_kv(cache_ptr, kv_scale_ptr, slot_ptr, head, pairs, out_lo, out_hi, num_q_heads, num_kv_heads,
                  block_size, stride_ckv, stride_cblock, stride_cslot, stride_chead, HALF)


@dataclass(frozen=True, slots=True)
class GemvConfig:
    block_n: int  # output rows per program (the qkv kernel: rows = 2 x rotary pairs)
    block_k: int
    num_warps: int


def choose_config(kind: str, k: int, weight_bytes: int = 2, w8a8: bool = False) -> GemvConfig:
    """Launch configs from sweeps on an H200 (benches/RESULTS.md). bf16 (benches/bench_gemv.py):
    many small programs (2 rows) stream best for plain products -- 4-10% faster than cuBLAS at
    Llama-3.1-8B's shapes; the fused variants, whose prologue re-reads the input and norm weight per
    K tile, want more rows per program to amortise it. Configs swept at Qwen3-30B-A3B's smaller
    shapes were faster per kernel and not per step (twenty-first session).

    FP8 weights (weight_bytes 1; `bench_fp8.py --sweep-gemv`, twenty-second session): each fp8 weight
    is widened in registers, so wide tiles cost registers, and at 8 warps the qkv kernel held one
    program an SM (180 registers: 20 us for Llama-3.1-8B's qkv, 1.25 TB/s). Four warps over short
    tiles keep three or more programs an SM: qkv + rotary 12.2 us (W8A8: the input's fp8 codes are
    computed per tile, so 16 rows share them) or 15.6 (weight-only: 4 rows x 256), gate_up + SiLU
    36.5 us (was 75.5), down 15.6 (21.4), o_proj 5.6 (6.5)."""
    if weight_bytes == 1:
        if kind == "plain":
            return GemvConfig(4, min(1024, triton.next_power_of_2(k)), 4)
        if kind == "silu":
            return GemvConfig(8, min(512, triton.next_power_of_2(k)), 4)
        if kind == "rope":
            return GemvConfig(16, min(512, triton.next_power_of_2(k)), 4) if w8a8 else GemvConfig(
                4, min(256, triton.next_power_of_2(k)), 2)
        raise ValueError(f"unknown gemv kind {kind!r}")
    block_k = min(1024, triton.next_power_of_2(k))
    if kind == "plain":
        # Long rows (down_proj, K = 14336) already give each program a long stream: one row each.
        return GemvConfig(1 if k > 8192 else 2, block_k, 4)
    if kind == "silu":
        return GemvConfig(4, block_k, 4)
    if kind == "rope":
        return GemvConfig(16, min(block_k, 512), 8)
    raise ValueError(f"unknown gemv kind {kind!r}")


def _check_input(x: torch.Tensor, weight: torch.Tensor, norm_weight: torch.Tensor | None,
                 weight_scale: torch.Tensor | None = None, *, row_scales: bool = True) -> int:
    """K, after checking x, the weight's layout, the norm weight and (row_scales: the per-row kind,
    else the caller checks its own) the weight scales."""
    k = weight.shape[1]
    if x.dim() != 2 or x.shape[0] != 1 or x.shape[1] != k or x.stride(-1) != 1:
        raise ValueError(f"x must be a contiguous [1, {k}] row, got {tuple(x.shape)} (strides {x.stride()})")
    if weight.stride(1) != 1:
        raise ValueError("gemv needs a row-major weight [N, K]")
    if norm_weight is not None and norm_weight.shape != (k,):
        raise ValueError(f"norm weight must be [{k}], got {tuple(norm_weight.shape)}")
    if not row_scales:
        return k
    if weight.dtype in (torch.float8_e4m3fn, torch.int8) and weight_scale is None:
        raise ValueError(f"an {weight.dtype} weight needs its per-row weight_scale")
    if weight_scale is not None and (weight_scale.dtype != torch.float32 or weight_scale.shape != weight.shape[:1]
                                     or weight_scale.stride(0) != 1):
        raise ValueError(f"weight_scale must be contiguous float32 [{weight.shape[0]}], got "
                         f"{weight_scale.dtype} {tuple(weight_scale.shape)}")
    return k


def _check_output(weight: torch.Tensor, silu_mul: bool, residual: torch.Tensor | None) -> int:
    """The output width: the weight's rows, half of them with silu_mul ([gate | up]); the residual
    must be a row of it."""
    n = weight.shape[0]
    if silu_mul and n % 2:
        raise ValueError(f"silu_mul needs an even number of rows [gate | up], got {n}")
    n_out = n // 2 if silu_mul else n
    if residual is not None and (residual.shape != (1, n_out) or residual.stride(-1) != 1):
        raise ValueError(f"residual must be a contiguous [1, {n_out}] row, got {tuple(residual.shape)}")
    return n_out


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    silu_mul: bool = False,
    residual: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    weight_scale: torch.Tensor | None = None,
    config: GemvConfig | None = None,
) -> torch.Tensor:
    """y = W @ rms_norm(x) (+ bias) [-> silu(gate) * up] [+ residual] for one token x [1, K].
    An fp8 weight comes with weight_scale, float32 [N]: W = weight * weight_scale[:, None].

    Returns y [1, N] (N / 2 with silu_mul)."""
    k = _check_input(x, weight, norm_weight, weight_scale)
    n_out = _check_output(weight, silu_mul, residual)
    # 16-bit weights on a GPU with tensor cores: dense_gemv_cuda.py's kernel (weight-only fp8 stays here:
    # that kernel's fp8 path quantizes the input).
    if (config is None and weight_scale is None and x.is_cuda
            and dense_gemv_cuda.supported(x, weight, bias=bias, norm_weight=norm_weight, residual=residual,
                                          silu_mul=silu_mul, out_dtype=out_dtype)):
        return dense_gemv_cuda.dense_mma_product(x, weight, bias, norm_weight=norm_weight, eps=eps,
                                                 silu_mul=silu_mul, residual=residual, out_dtype=out_dtype)
    out = torch.empty(1, n_out, dtype=out_dtype or x.dtype, device=x.device)
    cfg = config or choose_config("silu" if silu_mul else "plain", k, weight.element_size())
    _gemv_kernel[(triton.cdiv(n_out, cfg.block_n),)](
        out, weight, weight_scale if weight_scale is not None else x, bias if bias is not None else weight, x,
        residual if residual is not None else x, norm_weight if norm_weight is not None else x, eps, n_out, k,
        weight.stride(0), NORM=norm_weight is not None, HAS_BIAS=bias is not None, SILU_MUL=silu_mul,
        HAS_RESIDUAL=residual is not None, HAS_W_SCALE=weight_scale is not None, BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k, num_warps=cfg.num_warps, **pdl_launch(x.device),
    )
    return out


def qkv_rope_gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    *,
    norm_weight: torch.Tensor | None,
    eps: float,
    rope_row: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_cache: torch.Tensor,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    weight_scale: torch.Tensor | None = None,
    kv_scale: torch.Tensor | None = None,
    w8a8: bool = False,
    input_scale: torch.Tensor | None = None,
    config: GemvConfig | None = None,
) -> torch.Tensor:
    """rms_norm(x) @ W_qkv^T (+ bias) for one token, rotated (neox, full head_dim) by `rope_row`
    ([cos | sin] float32, head_dim wide); k and v go into kv_cache [2, blocks, block_size, Hkv, D]
    at slot_mapping[0] (-1: nowhere); an FP8 cache stores them divided by kv_scale, float32
    (k_scale, v_scale) (None: 1.0). Returns q [1, Hq, D]. An fp8 weight comes with
    weight_scale, float32 [rows] (as gemv), and so does an int8 one; with w8a8 the normed input is
    rounded through the weight's format too (fp8 or int8), per token or by the static input_scale
    (float32 [1]), as w8a8_dot_gemv.py quantizes it."""
    k = _check_input(x, weight, norm_weight, weight_scale)
    if w8a8 and weight.dtype not in (torch.float8_e4m3fn, torch.int8):
        raise ValueError(f"w8a8 needs a float8_e4m3fn or int8 weight, got {weight.dtype}")
    heads = num_q_heads + 2 * num_kv_heads
    if weight.shape[0] != heads * head_dim:
        raise ValueError(f"qkv weight has {weight.shape[0]} rows, expected {heads} heads x {head_dim}")
    if head_dim % 2 or rope_row.shape[-1] != head_dim or rope_row.dtype != torch.float32:
        raise ValueError(f"rope_row must be float32 [cos | sin] of width {head_dim}, got {tuple(rope_row.shape)}")
    if kv_cache.dim() != 5 or kv_cache.shape[3:] != (num_kv_heads, head_dim) or kv_cache.stride(-1) != 1:
        raise ValueError(f"kv_cache must be [2, blocks, block_size, {num_kv_heads}, {head_dim}], "
                         f"got {tuple(kv_cache.shape)}")
    half = head_dim // 2
    if (config is None and x.is_cuda
            and dense_gemv_cuda.qkv_rope_supported(x, weight, weight_scale=weight_scale, bias=bias,
                                                   norm_weight=norm_weight, slot_mapping=slot_mapping,
                                                   kv_cache=kv_cache, head_dim=head_dim, w8a8=w8a8,
                                                   input_scale=input_scale)):
        assert norm_weight is not None
        return dense_gemv_cuda.dense_qkv_rope(
            x, weight, bias, weight_scale=weight_scale, norm_weight=norm_weight, eps=eps, rope_row=rope_row,
            slot_mapping=slot_mapping, kv_cache=kv_cache, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
            head_dim=head_dim, kv_scale=kv_scale if kv_scale is not None else unit_kv_scales(x.device),
            input_scale=input_scale)
    cfg = config or choose_config("rope", k, weight.element_size(), w8a8)
    block_p = max(1, min(cfg.block_n // 2, half & -half))  # pairs: a power of two dividing half
    q = torch.empty(1, num_q_heads, head_dim, dtype=x.dtype, device=x.device)
    _qkv_rope_kernel[(heads * (half // block_p),)](
        q, kv_cache, weight, weight_scale if weight_scale is not None else x, bias if bias is not None else weight, x,
        norm_weight if norm_weight is not None else x, eps, rope_row, slot_mapping,
        kv_scale if kv_scale is not None else unit_kv_scales(x.device),
        input_scale if input_scale is not None else unit_kv_scales(x.device), k, weight.stride(0),
        num_q_heads, num_kv_heads, kv_cache.shape[2], kv_cache.stride(0), kv_cache.stride(1),
        kv_cache.stride(2), kv_cache.stride(3),
        HEAD_DIM=head_dim, NORM=norm_weight is not None, HAS_BIAS=bias is not None,
        HAS_W_SCALE=weight_scale is not None, W8A8=w8a8, STATIC=input_scale is not None,
        INT8=w8a8 and weight.dtype == torch.int8, BLOCK_P=block_p,
        BLOCK_K=cfg.block_k, BLOCK_X=token_stats_block(k) if w8a8 else 16, num_warps=cfg.num_warps,
        **pdl_launch(x.device),
    )
    return q
