"""The order in which a GEMM's programs walk their output tiles.

Programs launch in id order, and the ones running at the same time should share operand tiles in
L2: consecutive ids walk down a band of GROUP_M row tiles of x before moving to the next column
tile of W, so a band's programs reuse the same weight tiles while they are cached (the "grouped"
ordering of Triton's matmul tutorial). Used by the weight-only GEMMs (int4_matmul.py,
fp8_weight_gemm.py), whose weight is the larger operand.
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
