"""Output tiles of the weight-only GEMMs (int4_matmul.py, fp8_weight_gemm.py): the order their
programs walk them, and the product of a tile in either orientation.

Order: programs launch in id order, and the ones running at the same time should share operand
tiles in L2: consecutive ids walk down a band of GROUP_M row tiles of x before moving to the next
column tile of W, so a band's programs reuse the same weight tiles while they are cached (the
"grouped" ordering of Triton's matmul tutorial); the weight is the larger operand here.

Orientation: y = x W^T with the tile [BLOCK_M tokens, BLOCK_N rows], or swapped (SWAP_AB), y^T =
W x^T with the tile [BLOCK_N, BLOCK_M]: then the weight tile, dequantized or widened in registers,
is the MMA's A operand, which Hopper's warpgroup MMA reads from registers, and x^T, loaded as is,
is the B operand. Each GEMM's `choose_gemm_config` says at which batch sizes that pays.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def band_tile(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """This program's output tile of an [M, N] product: (its token indices [BLOCK_M], their mask,
    its weight row indices [BLOCK_N], their mask)."""
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    band_size = GROUP_M * num_n
    first_m = (pid // band_size) * GROUP_M
    band_m = tl.minimum(num_m - first_m, GROUP_M)
    toks = (first_m + (pid % band_size) % band_m) * BLOCK_M + tl.arange(0, BLOCK_M)
    rows = ((pid % band_size) // band_m) * BLOCK_N + tl.arange(0, BLOCK_N)
    return toks, toks < M, rows, rows < N


@triton.jit
def zero_tile(BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SWAP_AB: tl.constexpr):
    """The fp32 accumulator of a tile, in the orientation's shape."""
    if SWAP_AB:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    return acc


@triton.jit
def dot_tile(a, w, acc, DOT_PRECISION: tl.constexpr, SWAP_AB: tl.constexpr):
    """acc + a [BLOCK_M, k] @ w [BLOCK_N, k]^T, or its transpose with SWAP_AB."""
    if SWAP_AB:
        acc = tl.dot(w, tl.trans(a), acc, input_precision=DOT_PRECISION)
    else:
        acc = tl.dot(a, tl.trans(w), acc, input_precision=DOT_PRECISION)
    return acc


@triton.jit
def per_row(v, SWAP_AB: tl.constexpr):
    """A per-weight-row vector [BLOCK_N] broadcast over the tile (scales, bias)."""
    if SWAP_AB:
        b = v[:, None]
    else:
        b = v[None, :]
    return b


@triton.jit
def store_tile(out_ptr, acc, toks, tmask, rows, rmask, stride_om, SWAP_AB: tl.constexpr):
    """The tile into out [M, N] (row stride stride_om), in out's dtype."""
    if SWAP_AB:
        out = out_ptr + toks.to(tl.int64)[None, :] * stride_om + rows[:, None]
        mask = rmask[:, None] & tmask[None, :]
    else:
        out = out_ptr + toks.to(tl.int64)[:, None] * stride_om + rows[None, :]
        mask = tmask[:, None] & rmask[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask)
