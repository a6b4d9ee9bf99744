"""int4 weight-only matmuls (AWQ / GPTQ checkpoints, layers/quant/int4_pack.py): y = x @ W.T with W
dequantized inside the kernel, so a decode step reads half a byte per weight instead of two.

One layout for every checkpoint format (int4_pack.py converts AWQ and GPTQ to it once, at load):

  packed  int32 [N, K/8]   K in blocks of 8T (T words per row, T a power of two dividing the group's
                           words): word i of block b holds, in bits [4j, 4j + 4), q[n, 8T b + T j + i]
  scales  [N, G]           fp16 / bf16 / fp32, as the checkpoint stores them (fp32 arithmetic here)
  zeros   uint8 [N, G]     integer zero points (GPTQ v1's "+1" already applied)

  W[n, k] = (q[n, k] - zeros[n, g]) * scales[n, g],  g = k // group_size

Why this interleave: nibble j of a block's T words is T *consecutive* k, so the activations a nibble
plane multiplies are one contiguous load in the same register layout as the packed words (with a
k-sequential nibble order Triton converts every nibble's activations through shared memory, two
barriers each, seen in the sm_90 SASS), and a block lies inside one group, so its scale and zero
are one value per row.

Three paths, by the number of rows M of x (and a fourth, on GPUs with tensor cores: products of 1-16
rows of a weight that also carries int4_gemv_cuda.py's stream run that CUDA kernel, which streams the
weights faster than the GEMV below and costs about what one row costs up to 8; `int4_linear` and
`int4_gemv` check it first):

- GEMV (decode, M <= GEMV_MAX_M): one program owns BLOCK_N rows of W for one token and streams
  them over K in tiles of 1024-2048 weights per row. Batch-1 int4 decode on an H200 is close to
  issue-bound (4.8 TB/s is ~37 weights per SM per clock; an SM issues 128 thread-instructions per
  clock), so the inner loop is kept short: a nibble masked in place is OR-ed into the bits of the
  float 2^(23 - 4j), which then reads as 2^(23 - 4j) + q exactly (one LOP3 and a subtract instead
  of shift, and, and the quarter-rate int-to-float), then one FMA with x. Nibbles 5..7 would reach
  the exponent bits, so the word is shifted down by 20 once for them. Scale and zero apply per 4
  words on the partial sums, s * (sum q x - z * sum x), so nothing per weight touches them. The
  sm_90 SASS of this loop is ~5 instructions per weight (constants re-materialised, activation
  conversions shared by the program's 8 rows): expect the kernel at roughly 1.5x its int4 read
  time, not at it; closing that gap needs packed fp16x2 dequantisation (inline PTX), which the
  CPU interpreter cannot run.
  The fused one-token decode path (attention/fused_decode.py) runs this kernel with gemv.py's
  fusions, constexpr flags that are off for int4_linear (the same sm_90 PTX loop as without them):
  NORM, the input RMSNorm in the prologue (each nibble plane's activations times the norm weight as
  they load, their squares summed in the same loop, rstd applied to the row sums: every term, the
  zero point's z * sum x included, is linear in x); SILU_MUL, a program streams its gate rows and
  the up rows N further on against the same activations; HAS_RESIDUAL; the epilogue (bias, SiLU,
  residual, roundings) is gemv.py's `_store_rows`.
- GEMM (prefill, mid-size batches): each nibble plane of a block dequantized in registers to the
  activation dtype and multiplied with tl.dot against the matching T columns of x (fp32
  accumulation); from 65 rows swapped, y^T = W x^T, so Hopper's warpgroup MMA reads the plane from
  registers (`choose_gemm_config`). Needs T >= 16 (group size >= 128, or one group); smaller groups
  take the dequantize path at every M > GEMV_MAX_M.
- dequantize + cuBLAS (M >= DEQUANT_MIN_M): W written out in the activation dtype (~3 TB/s of
  read + write, 2.5 bytes per weight), then F.linear. The pass costs a fixed ~140 us per Llama-8B
  layer, but the GEMM above widens every plane on CUDA cores beside its MMAs and grows with M,
  so from 48 rows the pass and cuBLAS win (H200, a layer's four products: 330 vs 341 us at 48
  rows, 343 vs 485 at 128, 474 vs 723 at 512; a server's 400 x (256, 256) 7,976 -> 10,829 output
  tok/s). The scratch W lives for one product; inside a decode CUDA graph it comes from the
  graph pool, at most the largest projection (gate_up: 235 MB in bf16).

The GEMV's launch configs come from benches/bench_int4.py's sweep on the H200. The GEMM's M is
`do_not_specialize` and the GEMV takes its token from the grid, so a new batch size never compiles a
new variant while serving; row strides are the layer's K and N (the runner passes contiguous rows),
fixed per layer and left specialised, so loads stay 16-byte wide.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ferrox.kernels import int4_gemv_cuda
from ferrox.kernels.gemv import _input_tile, _store_rows
from ferrox.kernels.tile_order import band_tile, dot_tile, per_row, store_tile, zero_tile

GEMV_MAX_M = 4
DEQUANT_MIN_M = 48  # measured crossover (benches/bench_weight_only_gemm.py): see the docstring
MAX_INTERLEAVE = 64  # T at most (words per block row); 16 for group size 128


@triton.jit
def _plane(word, J: tl.constexpr):
    """Nibble J (0..4) of `word` as the float 2^(23 - 4J) + q, exactly."""
    magic = (150 - 4 * J) << 23  # the bits of float 2^(23 - 4J); q << 4J lands in its low mantissa
    return ((word & (0xF << (4 * J))) | magic).to(tl.float32, bitcast=True)


@triton.jit
def _plane_value(p, p_hi, J: tl.constexpr):
    """q in fp32 for nibble J (0..7) of words p (p_hi = p >> 20)."""
    if J < 5:
        return _plane(p, J) - (1 << (23 - 4 * J))
    else:
        return _plane(p_hi, J - 5) - (1 << (23 - 4 * (J - 5)))


@triton.jit
def _plane_minus_zero(p, p_hi, zero, J: tl.constexpr):
    """q - z in fp32 for nibble J (0..7) of words p (p_hi = p >> 20), zero [BLOCK_N, 1] in fp32."""
    if J < 5:
        return _plane(p, J) - (zero + (1 << (23 - 4 * J)))
    else:
        return _plane(p_hi, J - 5) - (zero + (1 << (23 - 4 * (J - 5))))


@triton.jit
def _group_sums(t, xs4, scales_ptr, zeros_ptr, offs, mask, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr):
    """A K tile's contribution to each row: t [BLOCK_N, BLOCK_W] holds per word sum(q x), xs4 per 4
    words sum(x). A thread's 4 words lie in one block: fold them first, then one scale and zero per
    4 words (offs: their [N, G] offsets), s * (sum q x - z * sum x)."""
    t4 = tl.sum(tl.reshape(t, [BLOCK_N, BLOCK_W // 4, 4]), axis=2)
    s = tl.load(scales_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    z = tl.load(zeros_ptr + offs, mask=mask, other=0).to(tl.float32)
    return s * (t4 - z * xs4)


@triton.jit
def _int4_gemv_kernel(
    out_ptr,
    x_ptr,
    packed_ptr,
    scales_ptr,
    zeros_ptr,
    bias_ptr,
    res_ptr,  # [M, N] (HAS_RESIDUAL), out's strides
    norm_w_ptr,  # [K] RMSNorm weight (NORM)
    eps,
    N,  # output rows (with SILU_MUL: the gate rows; up rows are N further on)
    KW,  # packed words per row, K / 8 (passed as is, so its divisibility is known: 16-byte masked loads)
    stride_w,
    stride_xm,
    stride_om,
    GROUP: tl.constexpr,
    T: tl.constexpr,  # words per block row (the layout's interleave)
    HAS_BIAS: tl.constexpr,
    NORM: tl.constexpr,  # x -> rms_norm(x) * norm_w first (the fused one-token path, module docstring)
    SILU_MUL: tl.constexpr,  # rows [0, N) are gate, [N, 2N) up: out = silu(gate) * up
    HAS_RESIDUAL: tl.constexpr,  # out = (W @ x) + residual, each rounded as the unfused ops round
    BLOCK_N: tl.constexpr,
    BLOCK_W: tl.constexpr,  # words per row per K tile, a multiple of T; 4 words a thread (see the config)
):
    # Token-major grid: the programs of one row block for every token run side by side, so tokens
    # after the first find the block's weights in L2.
    m = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows[:, None] < N
    G = tl.cdiv(KW * 8, GROUP)
    cols = tl.arange(0, BLOCK_W)[None, :]
    # Word c of a tile is word c % T of block c // T: its nibble j multiplies x[8T (c // T) + T j + c % T].
    # x is loaded [1, BLOCK_W], in the packed tile's own register layout (no conversion per nibble).
    x_cols = cols + (cols // T) * (7 * T)
    x_row = x_ptr + m.to(tl.int64) * stride_xm + x_cols
    norm_row = norm_w_ptr + x_cols  # (NORM: the norm weight of each x)
    w_rows = packed_ptr + rows.to(tl.int64)[:, None] * stride_w + cols
    cols4 = tl.arange(0, BLOCK_W // 4)[None, :] * 4
    g4 = (cols4 // T) * (8 * T)  # first k of each 4 words' block, from the tile's start
    acc = tl.zeros([BLOCK_N, BLOCK_W // 4], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_N, BLOCK_W // 4], dtype=tl.float32)
    sq = tl.zeros([1, BLOCK_W], dtype=tl.float32)
    for w0 in range(0, KW, BLOCK_W):
        wmask = cols < KW - w0
        wmask4 = cols4 < KW - w0
        p = tl.load(w_rows + w0, mask=rmask & wmask, other=0, eviction_policy="evict_first")
        p_hi = p >> 20  # nibbles 5..7 moved down to 0..2
        t = tl.zeros([BLOCK_N, BLOCK_W], dtype=tl.float32)  # per word: sum over its 8 nibbles of q * x
        xs = tl.zeros([1, BLOCK_W], dtype=tl.float32)  # per word: sum of the x its nibbles multiply
        if SILU_MUL:
            p_up = tl.load(w_rows + N * stride_w + w0, mask=rmask & wmask, other=0, eviction_policy="evict_first")
            p_up_hi = p_up >> 20
            t_up = tl.zeros([BLOCK_N, BLOCK_W], dtype=tl.float32)
        for j in tl.static_range(8):
            # With NORM, xj is x times the norm weight and h the raw x (the RMS statistic's).
            xj, h = _input_tile(x_row, norm_row, 8 * w0 + j * T, wmask, NORM)
            xs += xj
            t += _plane_value(p, p_hi, j) * xj
            if SILU_MUL:
                t_up += _plane_value(p_up, p_up_hi, j) * xj
            if NORM:
                sq += h * h
        xs4 = tl.sum(tl.reshape(xs, [1, BLOCK_W // 4, 4]), axis=2)
        offs = rows[:, None] * G + (8 * w0 + g4) // GROUP
        acc += _group_sums(t, xs4, scales_ptr, zeros_ptr, offs, rmask & wmask4, BLOCK_N, BLOCK_W)
        if SILU_MUL:
            acc_up += _group_sums(t_up, xs4, scales_ptr, zeros_ptr, offs + N * G, rmask & wmask4, BLOCK_N, BLOCK_W)
    # The norm's rstd scales whole row sums: every term above, the zero point's z * sum x included,
    # is linear in x.
    y = tl.sum(acc, axis=1)
    up = y  # (the up rows' sums with SILU_MUL)
    if NORM:
        rstd = tl.rsqrt(tl.sum(sq) / (KW * 8) + eps)
        y = y * rstd
    if SILU_MUL:
        up = tl.sum(acc_up, axis=1)
        if NORM:
            up = up * rstd
    _store_rows(out_ptr + m.to(tl.int64) * stride_om, x_ptr, bias_ptr, res_ptr + m.to(tl.int64) * stride_om, y, up,
                rows, rows < N, N, HAS_BIAS, SILU_MUL, HAS_RESIDUAL)


@triton.jit(do_not_specialize=["M"])
def _int4_gemm_kernel(
    out_ptr,
    x_ptr,
    packed_ptr,
    scales_ptr,
    zeros_ptr,
    bias_ptr,
    M,
    N,
    K,
    stride_w,
    stride_xm,
    stride_om,
    GROUP: tl.constexpr,
    T: tl.constexpr,  # >= 16: one nibble plane is one tl.dot over T columns of x
    HAS_BIAS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 activations (no tf32 rounding); ignored for 16-bit
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    GROUP_M: tl.constexpr,  # M tiles per band: neighbouring programs share weight tiles in L2
    SWAP_AB: tl.constexpr,  # the product as y^T = W x^T (tile_order.py; choose_gemm_config says when)
):
    toks, tmask, rows, rmask = band_tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    lanes = tl.arange(0, T)
    w_rows = packed_ptr + rows.to(tl.int64)[:, None] * stride_w + lanes[None, :]
    x_rows = x_ptr + toks.to(tl.int64)[:, None] * stride_xm + lanes[None, :]
    s_rows = rows * tl.cdiv(K, GROUP)
    acc = zero_tile(BLOCK_M, BLOCK_N, SWAP_AB)
    for b in range(0, K // (8 * T)):
        p = tl.load(w_rows + b * T, mask=rmask[:, None], other=0)
        p_hi = p >> 20
        g = (b * 8 * T) // GROUP
        s = tl.load(scales_ptr + s_rows + g, mask=rmask, other=0.0).to(tl.float32)[:, None]
        z = tl.load(zeros_ptr + s_rows + g, mask=rmask, other=0).to(tl.float32)[:, None]
        for j in tl.static_range(8):
            a = tl.load(x_rows + (b * 8 + j) * T, mask=tmask[:, None], other=0.0)
            w = (_plane_minus_zero(p, p_hi, z, j) * s).to(a.dtype)
            acc = dot_tile(a, w, acc, DOT_PRECISION, SWAP_AB)
    if HAS_BIAS:
        acc += per_row(tl.load(bias_ptr + rows, mask=rmask, other=0.0).to(tl.float32), SWAP_AB)
    store_tile(out_ptr, acc, toks, tmask, rows, rmask, stride_om, SWAP_AB)


@triton.jit
def _int4_dequant_kernel(out_ptr, packed_ptr, scales_ptr, zeros_ptr, N, K, stride_w,
                         GROUP: tl.constexpr, T: tl.constexpr, NB: tl.constexpr, BLOCK_N: tl.constexpr):
    """One program: BLOCK_N rows of NB consecutive blocks (8T NB columns of W). The planes of every
    block are laid out [block, plane, word] in registers, which is W's natural column order, so each
    row goes out as one contiguous run of 8T NB values (wide stores; writing plane by plane stored
    2T-byte pieces and ran the pass at ~2 TB/s)."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < N
    b0 = tl.program_id(1) * NB
    p = tl.load(packed_ptr + rows.to(tl.int64)[:, None] * stride_w + b0 * T + tl.arange(0, NB * T)[None, :],
                mask=rmask[:, None], other=0)
    blocks = b0 + tl.arange(0, NB)
    g = rows[:, None] * tl.cdiv(K, GROUP) + (blocks[None, :] * 8 * T) // GROUP  # a block lies in one group
    s = tl.load(scales_ptr + g, mask=rmask[:, None], other=0.0).to(tl.float32)
    z = tl.load(zeros_ptr + g, mask=rmask[:, None], other=0).to(tl.float32)
    shifts = (tl.arange(0, 8) * 4)[None, None, :, None]
    q = ((tl.reshape(p, [BLOCK_N, NB, 1, T]) >> shifts) & 0xF).to(tl.float32)  # [rows, block, plane, word]
    w = (q - z[:, :, None, None]) * s[:, :, None, None]
    cols = b0 * 8 * T + tl.arange(0, NB * 8 * T)
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * K + cols[None, :],
             tl.reshape(w, [BLOCK_N, NB * 8 * T]).to(out_ptr.dtype.element_ty), mask=rmask[:, None])


# ---- layout ---------------------------------------------------------------------------------------------
def interleave_words(k: int, group: int) -> int:
    """T of the packed layout for a K x group weight: the largest power of two <= MAX_INTERLEAVE that
    divides the group's words and K / 8, so a block (8T weights of a row) never straddles a group.
    At least 4 (the GEMV folds 4 words of one block at a time): K and the group size must be
    multiples of 32."""
    words = k // 8 if group >= k else group // 8
    t = MAX_INTERLEAVE
    while t > 1 and (words % t or (k // 8) % t):
        t //= 2
    if t < 4 or k % 32:
        raise ValueError(f"int4 weights need in_features ({k}) and group_size ({group}) divisible by 32")
    return t


# ---- launch configs -----------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class GemvConfig:
    block_n: int  # rows of W per program (each thread holds all of them: its activations serve them all)
    num_warps: int  # the K tile is 128 words (1024 weights) per warp, 4 words a thread

    @property
    def block_w(self) -> int:
        # 4 words a thread across every warp: the [1, BLOCK_W] activation loads then take the packed
        # tile's register layout (Triton gives a tile whose columns spread over all threads, with no
        # warp along the rows, the same layout as a row of it), so nothing converts through shared memory.
        return 128 * self.num_warps


@dataclass(frozen=True, slots=True)
class GemmConfig:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    group_m: int = 8
    swap_ab: bool = False  # y^T = W x^T: the dequantized plane as the MMA's register operand


def choose_gemv_config(n: int, k: int, *, silu_mul: bool = False) -> GemvConfig:
    """8 rows per program, 2 warps (a 2048-weight K tile) when K has room for them. A 4096 x 4096
    projection then runs 512 programs of 64 threads, each with 32 packed words (128 bytes) in flight
    per iteration, ~32 KB per SM; each thread's activations serve its 8 rows. silu_mul (n: the gate
    rows): 4 gate rows and their 4 up rows, the same 8 rows streamed and registers held (derived,
    not yet swept on the H200: benches/bench_int4.py)."""
    return GemvConfig(min(4 if silu_mul else 8, triton.next_power_of_2(n)), 2 if k >= 2048 else 1)


def choose_gemm_config(m: int, dtype: torch.dtype = torch.bfloat16) -> GemmConfig:
    """Two tile shapes only (int4_linear takes the first: from DEQUANT_MIN_M rows it dequantizes;
    the second serves int4_gemm called on larger batches): every config is a compiled variant,
    and the engine's warm-up reaches both classes (worker/warmup.py), so none compiles while serving.
    fp32 activations take two pipeline stages (three of the large tile would need 216 KB of shared
    memory, at the sm_90 limit)."""
    stages = 2 if dtype == torch.float32 else 3
    if m <= 64:
        return GemmConfig(16, 64, 4, stages)
    # Swapped (y^T = W x^T: Hopper's warpgroup MMA takes the dequantized plane from registers): a
    # layer of Llama-3.1-8B's four products at 128 tokens 679 -> 496 us, at 512 1166 -> 739 on the
    # H200; at 8-64 tokens the swap was slower (215 -> 258 at 8; benches/RESULTS.md, Dec 2).
    return GemmConfig(128, 128, 8, stages, swap_ab=True)


# ---- entry points -------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Int4Weights:
    """A weight in the packed layout above (what the kernels take)."""

    packed: torch.Tensor  # int32 [N, K/8]
    scales: torch.Tensor  # [N, G]
    zeros: torch.Tensor  # uint8 [N, G]
    group_size: int  # k per group (K for one group)
    interleave: int  # T
    mma: torch.Tensor | None = None  # the codes again, for 1-16 token products on tensor cores (int4_gemv_cuda.py)

    @property
    def out_features(self) -> int:
        return self.packed.shape[0]

    @property
    def in_features(self) -> int:
        return self.packed.shape[1] * 8

    def check(self) -> None:
        n, k, group, t = self.out_features, self.in_features, self.group_size, self.interleave
        if self.packed.dtype != torch.int32 or self.packed.stride(1) != 1:
            raise ValueError(f"packed must be int32 [N, K/8] with contiguous rows, got {self.packed.dtype} "
                             f"{tuple(self.packed.shape)}")
        groups = -(-k // group)
        if self.scales.shape != (n, groups) or self.zeros.shape != (n, groups) or self.zeros.dtype != torch.uint8:
            raise ValueError(f"scales / zeros must be [{n}, {groups}] (zeros uint8), got {tuple(self.scales.shape)} / "
                             f"{tuple(self.zeros.shape)} {self.zeros.dtype}")
        if not (self.scales.is_contiguous() and self.zeros.is_contiguous()):
            raise ValueError("scales and zeros must be contiguous")
        if t & (t - 1) or k % (8 * t) or (group < k and group % (8 * t)):
            raise ValueError(f"interleave {t} must be a power of two with 8T dividing K ({k}) and the group ({group})")


def _check_x(x: torch.Tensor, w: Int4Weights) -> None:
    if x.dim() != 2 or x.shape[1] != w.in_features or x.stride(1) != 1:
        raise ValueError(f"x must be [M, {w.in_features}] with contiguous rows, got {tuple(x.shape)} "
                         f"(strides {x.stride()})")


def int4_gemv(x: torch.Tensor, w: Int4Weights, bias: torch.Tensor | None = None,
              config: GemvConfig | None = None, *, validate: bool = True, norm_weight: torch.Tensor | None = None,
              eps: float = 1e-6, silu_mul: bool = False, residual: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ W.T (+ bias) -> [M, N] in x's dtype; one program per (token, row block), or, for a
    weight carrying the tensor-core stream on a GPU (and no explicit config), int4_gemv_cuda's kernel
    with the same fusions. validate=False skips the weight's checks (int4_linear: the runner checked its
    weight once).

    The fused one-token path's options (attention/fused_decode.py; kernels/gemv.py for float
    weights): norm_weight, each token RMS-normed first, rms_norm(x) * norm_weight (eps); silu_mul,
    W's rows are [gate | up] and the result silu(gate) * up, [M, N / 2]; residual, [M, N_out]
    added to the result (both rounded to x's dtype, as the unfused ops store them)."""
    if validate:
        w.check()
        _check_x(x, w)
    m, n, k = x.shape[0], w.out_features, w.in_features
    if silu_mul and n % 2:
        raise ValueError(f"silu_mul needs an even number of rows [gate | up], got {n}")
    n_out = n // 2 if silu_mul else n
    if norm_weight is not None and (norm_weight.shape != (k,) or norm_weight.stride(0) != 1):
        raise ValueError(f"norm weight must be contiguous [{k}], got {tuple(norm_weight.shape)}")
    if residual is not None and (residual.shape != (m, n_out) or not residual.is_contiguous()):
        raise ValueError(f"residual must be contiguous [{m}, {n_out}], got {tuple(residual.shape)}")
    if config is None and w.mma is not None and int4_gemv_cuda.supported(
            x, w.mma, w.scales, bias, norm_weight=norm_weight, silu_mul=silu_mul, residual=residual):
        return int4_gemv_cuda.int4_mma_product(x, w, bias, norm_weight=norm_weight, eps=eps, silu_mul=silu_mul,
                                               residual=residual)
    out = torch.empty(m, n_out, dtype=x.dtype, device=x.device)
    cfg = config or choose_gemv_config(n_out, k, silu_mul=silu_mul)
    _int4_gemv_kernel[(m, triton.cdiv(n_out, cfg.block_n))](
        out, x, w.packed, w.scales, w.zeros, bias if bias is not None else w.scales,
        residual if residual is not None else out, norm_weight if norm_weight is not None else x, eps, n_out,
        k // 8, w.packed.stride(0), x.stride(0), out.stride(0), GROUP=w.group_size, T=w.interleave,
        HAS_BIAS=bias is not None, NORM=norm_weight is not None, SILU_MUL=silu_mul,
        HAS_RESIDUAL=residual is not None, BLOCK_N=cfg.block_n, BLOCK_W=cfg.block_w, num_warps=cfg.num_warps,
    )
    return out


def gemm_supported(w: Int4Weights) -> bool:
    return w.interleave >= 16  # tl.dot wants K >= 16 per plane


def int4_gemm(x: torch.Tensor, w: Int4Weights, bias: torch.Tensor | None = None,
              config: GemmConfig | None = None, *, validate: bool = True) -> torch.Tensor:
    """x [M, K] @ W.T (+ bias) -> [M, N] in x's dtype, planes of W dequantized in registers for tl.dot."""
    if validate:
        w.check()
        _check_x(x, w)
    if not gemm_supported(w):
        raise ValueError(f"the int4 GEMM needs interleave >= 16 (group_size >= 128), got {w.interleave}")
    m, n, k = x.shape[0], w.out_features, w.in_features
    cfg = config or choose_gemm_config(m, x.dtype)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n),)
    _int4_gemm_kernel[grid](
        out, x, w.packed, w.scales, w.zeros, bias if bias is not None else w.scales, m, n, k, w.packed.stride(0),
        x.stride(0), out.stride(0), GROUP=w.group_size, T=w.interleave, HAS_BIAS=bias is not None,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32", BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        GROUP_M=cfg.group_m, SWAP_AB=cfg.swap_ab, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out


def int4_dequantize(w: Int4Weights, dtype: torch.dtype, *, validate: bool = True, block_n: int = 8,
                    block_words: int = 64, num_warps: int = 4) -> torch.Tensor:
    """W [N, K] in `dtype`, k in natural order. A program writes block_n rows of block_words packed
    words (8 block_words columns: as many whole blocks of the layout as fit, at least one); the
    defaults are the fastest of a sweep on the H200 (RESULTS.md, twenty-third session)."""
    if validate:
        w.check()
    n, k, t = w.out_features, w.in_features, w.interleave
    nb, blocks = max(1, block_words // t), k // (8 * t)
    while blocks % nb:
        nb //= 2
    out = torch.empty(n, k, dtype=dtype, device=w.packed.device)
    _int4_dequant_kernel[(triton.cdiv(n, block_n), blocks // nb)](
        out, w.packed, w.scales, w.zeros, n, k, w.packed.stride(0), GROUP=w.group_size, T=t, NB=nb,
        BLOCK_N=block_n, num_warps=num_warps,
    )
    return out


def int4_linear(x: torch.Tensor, w: Int4Weights, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] (contiguous rows) @ W.T (+ bias): the path for this M (module docstring). For the
    runner's hot path: w was checked when the runner was built, x is not checked here."""
    m = x.shape[0]
    if w.mma is not None and int4_gemv_cuda.supported(x, w.mma, w.scales, bias):  # 1-16 tokens
        return int4_gemv_cuda.int4_mma_product(x, w, bias)
    if m <= GEMV_MAX_M:
        return int4_gemv(x, w, bias, validate=False)
    if m < DEQUANT_MIN_M and gemm_supported(w):
        return int4_gemm(x, w, bias, validate=False)
    return F.linear(x, int4_dequantize(w, x.dtype, validate=False), bias)
