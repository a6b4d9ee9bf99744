"""Block-wise FP8 W8A8 products, as DeepSeek-V3 and the Qwen3-*-FP8 checkpoints define them
(layers/quant/fp8_block.py loads them): y = x @ W^T + bias with
- W float8 E4M3 [N, K] and one float32 scale per BN x BK block of it, w_scale [ceil(N / BN),
  ceil(K / BK)]: W[n, k] = w[n, k] * w_scale[n // BN, k // BK] (the last blocks may be partial);
- x quantized at run time per token and per group of BK inputs ("per-token-group"): each group's
  absmax maps to 448, so x[m, k] ~= q[m, k] * x_scale[m, k // BK].

Why scales inside the K loop: every K group of the product has its own pair of scales (the token's
for that group, the weight block's), so they cannot wait for the epilogue as row-wise scales do
(int8_gemm.py, torch._scaled_mm). The GEMM's K tile is the group: each step's tl.dot is one group's
fp32 partial sum, multiplied by both scales (token's, then weight's) and added to the fp32
accumulator: the arithmetic, and the order of its roundings, of vLLM's Triton w8a8_block_fp8_matmul.

Partial sums: Hopper's FP8 MMAs sum a group's products in an accumulator narrower than fp32 (about
14 bits kept) unless told otherwise (w8a8_dot_gemv.py's docstring); each group's partial sum is then
scaled and added to the fp32 accumulator, so the narrow sums span 128 products at most -- DeepSeek's
"promotion" every 128 inputs, and what vLLM's Triton kernel does (Triton's default for FP8 dots).
That is the default here (`fast_accum`). max_num_imprecise_acc=0 instead adds each MMA's result into
fp32 registers (exact group sums) but waits on every MMA: with it the 8B's 400-request throughput was
0.49x bf16's on an H200 (benches/RESULTS.md), so it stays a config switch for tests and sweeps.
Triton's FP8 MMA wants K tiles of 32 or more: a 16-wide group widens both tiles to fp16 (exact for
every E4M3 value) and multiplies those.

The quantizer rounds as `quantize_fp8_groups_torch` (the CPU path and the tests' reference) to the
bit: both divisions correctly rounded (tl.math.div_rn; torch divides tensor by tensor), the codes
rounded to nearest even by the float -> E4M3 conversion.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ferrox.kernels.tile_order import band_tile, store_tile

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
# An all-zero group (a padded batch row, a zeroed channel block) still gets a finite, nonzero scale.
_MIN_AMAX = 1e-12
_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _check_block_size(name: str, value: int) -> None:
    # Powers of two: tl.arange spans a group, and the weight-block row of an output row is a shift.
    if not isinstance(value, int) or value < 16 or value & (value - 1):
        raise ValueError(f"{name} must be a power of two >= 16, got {value!r}")


# ---- activations: per token and group ----------------------------------------------------------
@triton.jit
def _quantize_groups_kernel(x_ptr, q_ptr, scale_ptr, K, num_groups, stride_x, QMAX: tl.constexpr,
                            MIN_AMAX: tl.constexpr, GROUP: tl.constexpr, GROUPS: tl.constexpr):
    """GROUPS consecutive groups of one row: [GROUPS, GROUP] loaded at once, one absmax per group.
    Groups past the row's end are all masked (group g starts at g * GROUP >= K)."""
    row = tl.program_id(0).to(tl.int64)
    groups = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
    cols = groups[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    mask = cols < K
    v = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    scale = tl.math.div_rn(tl.maximum(tl.max(tl.abs(v), axis=1), MIN_AMAX), QMAX)
    q = tl.clamp(tl.math.div_rn(v, scale[:, None]), -QMAX, QMAX)
    tl.store(q_ptr + row * K + cols, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(scale_ptr + row * num_groups + groups, scale, mask=groups < num_groups)


def _check_activations(x: torch.Tensor, group: int) -> None:
    _check_block_size("group", group)
    if x.dim() != 2 or x.dtype not in _OUT_DTYPES:
        raise ValueError(f"x must be [M, K] in bfloat16, float16 or float32, got {x.dtype} {tuple(x.shape)}")


def quantize_fp8_groups_triton(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (fp8 [M, K], float32 [M, ceil(K / group)]): each row's groups of `group`
    consecutive inputs at their own scale (absmax / 448). One launch."""
    _check_activations(x, group)
    m, k = x.shape
    if x.stride(1) != 1:
        x = x.contiguous()
    num_groups = triton.cdiv(k, group)
    q = torch.empty((m, k), dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty((m, num_groups), dtype=torch.float32, device=x.device)
    if m and k:
        # ~1024 inputs a program: a 4096-wide decode token is four programs, not one long loop.
        groups = min(max(1, 1024 // group), triton.next_power_of_2(num_groups))
        grid = (m, triton.cdiv(num_groups, groups))
        _quantize_groups_kernel[grid](x, q, scale, k, num_groups, x.stride(0), QMAX=FP8_MAX, MIN_AMAX=_MIN_AMAX,
                                      GROUP=group, GROUPS=groups, num_warps=4)
    return q, scale


def quantize_fp8_groups_torch(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The same as quantize_fp8_groups_triton in torch ops (the CPU path, the tests' reference),
    the same bits on the same input."""
    _check_activations(x, group)
    m, k = x.shape
    num_groups = -(-k // group)
    padded = torch.zeros(m, num_groups * group, dtype=torch.float32, device=x.device)
    padded[:, :k] = x  # zeros past the end leave the last group's absmax as it is
    groups = padded.view(m, num_groups, group)
    amax = groups.abs().amax(dim=2).clamp(min=_MIN_AMAX)
    # A tensor divisor, not a Python number: on CUDA torch divides by a scalar through its
    # reciprocal (an ulp off now and then); tensor by tensor it divides correctly rounded, as the
    # CPU does and as the kernel's div_rn.
    scale = amax / amax.new_tensor(FP8_MAX)
    q = (groups / scale[:, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.view(m, num_groups * group)[:, :k].contiguous(), scale


# ---- the GEMM ----------------------------------------------------------------------------------
@triton.jit(do_not_specialize=["M"])
def _fp8_block_gemm_kernel(
    out_ptr,
    x_ptr,  # float8 E4M3 [M, K]
    x_scale_ptr,  # float32 [M, ceil(K / BK)]
    w_ptr,  # float8 E4M3 [N, K]
    w_scale_ptr,  # float32 [ceil(N / BN), ceil(K / BK)]
    bias_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_xs,
    stride_w,
    stride_ws,
    stride_om,
    HAS_BIAS: tl.constexpr,
    BN: tl.constexpr,  # the weight block's rows
    BLOCK_K: tl.constexpr,  # = the weight block's columns = the activations' group
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    GROUP_M: tl.constexpr,  # M tiles per band: neighbouring programs share weight tiles in L2
    FAST_ACCUM: tl.constexpr,  # the FP8 MMA's own accumulator within a group (module docstring)
):
    toks, tmask, rows, rmask = band_tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    cols = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + toks.to(tl.int64)[:, None] * stride_xm + cols[None, :]
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * stride_w + cols[None, :]
    x_scales = x_scale_ptr + toks.to(tl.int64) * stride_xs
    # One weight-block row per output row: a tile narrower than BN repeats one scale, a wider one
    # spans several blocks; either way a vector, so any power-of-two BLOCK_N works.
    w_scales = w_scale_ptr + (rows // BN) * stride_ws
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for g in range(0, tl.cdiv(K, BLOCK_K)):
        kmask = (g * BLOCK_K + cols) < K
        a = tl.load(x_rows + g * BLOCK_K, mask=tmask[:, None] & kmask[None, :], other=0.0)
        w = tl.load(w_rows + g * BLOCK_K, mask=rmask[:, None] & kmask[None, :], other=0.0)
        if BLOCK_K < 32:  # below the FP8 MMA's K: fp16 holds every E4M3 value exactly
            a = a.to(tl.float16)
            w = w.to(tl.float16)
        # The group's partial sum on its own (a fresh accumulator): in the FP8 MMA's accumulator, or
        # with FAST_ACCUM off each MMA's result added in fp32 registers (module docstring).
        if FAST_ACCUM:
            partial = tl.dot(a, tl.trans(w))
        else:
            partial = tl.dot(a, tl.trans(w), max_num_imprecise_acc=0)
        x_scale = tl.load(x_scales + g, mask=tmask, other=0.0)
        w_scale = tl.load(w_scales + g, mask=rmask, other=0.0)
        acc += partial * x_scale[:, None] * w_scale[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rows, mask=rmask, other=0.0).to(tl.float32)[None, :]
    store_tile(out_ptr, acc, toks, tmask, rows, rmask, stride_om, False)


@dataclass(frozen=True, slots=True)
class BlockGemmConfig:
    """A GEMM launch: the output tile (block_m tokens x block_n weight rows; the K tile is always
    the weight block's BK) and its warps and pipeline stages."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    group_m: int = 8
    fast_accum: bool = True  # group sums in the FP8 MMA's accumulator (module docstring)


# Tile candidates by batch size, preferred first: the first that launches at least _FILL_PROGRAMS
# programs is taken, else the last. The 17-64 and larger tiles come from an H200 sweep at
# Llama-3.1-8B's four shapes (benches/RESULTS.md, twenty-fifth session: 8 tiles at 64, 512 and 4096
# rows): 64 x 128 with 4 warps won or tied at 512 and 4096 rows (3-6% under the 128 x 128 / 8-warp
# tile; 128 x 128 with 4 warps spills, 2.5x slower), and at 64 rows the 128 x 64 tile for N = 4096
# (19 us against 24 for 32 x 64) and 64 x 128 where N fills the GPU with it. The decode tiles (2-16
# rows; one row takes w8a8_dot_gemv.py) are int8_gemm.py's measured choice, not swept here.
_FILL_PROGRAMS = 128  # about the H200's 132 SMs: fewer programs leave SMs idle on the weight stream
_DECODE_TILES = (BlockGemmConfig(16, 128, 4, 4), BlockGemmConfig(16, 64, 4, 4), BlockGemmConfig(16, 32, 4, 4))
_MID_TILES = (BlockGemmConfig(64, 128, 4, 4), BlockGemmConfig(128, 64, 4, 4))
_LARGE_TILES = (BlockGemmConfig(64, 128, 4, 3),)
# Shared memory for the pipelined operand tiles, (block_m + block_n) * BK bytes a stage: blocks
# wider than 128 get fewer stages (the H200 has 227 KB a block; the epilogue needs some).
_STAGE_BYTES = 160 * 1024


def choose_block_gemm_config(m: int, n: int, k: int, block: tuple[int, int]) -> BlockGemmConfig:
    """The tile for an [m, k] x [n, k]^T product with `block` = (BN, BK) weight blocks: by batch size
    (up to 16 rows a decode step, weight-stream bound; up to 64; beyond, compute-bound), the largest
    candidate that still fills the GPU. k is unused by this rule; it is in the signature so that a
    table tuned per (N, K), as vLLM ships its configs, can replace the rule without touching callers."""
    tiles = _DECODE_TILES if m <= 16 else _MID_TILES if m <= 64 else _LARGE_TILES
    cfg = next((t for t in tiles if triton.cdiv(m, t.block_m) * triton.cdiv(n, t.block_n) >= _FILL_PROGRAMS),
               tiles[-1])
    stages = max(1, min(cfg.num_stages, _STAGE_BYTES // ((cfg.block_m + cfg.block_n) * block[1])))
    return dataclasses.replace(cfg, num_stages=stages)


def _check(xq: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, w_scale: torch.Tensor,
           block: tuple[int, int], bias: torch.Tensor | None, out_dtype: torch.dtype) -> None:
    if len(block) != 2:
        raise ValueError(f"block must be (block_n, block_k), got {block!r}")
    _check_block_size("block_n", block[0])
    _check_block_size("block_k", block[1])
    if weight.dtype != FP8_DTYPE or weight.dim() != 2 or weight.stride(1) != 1:
        raise ValueError(f"weight must be a row-major float8_e4m3fn [N, K], got {weight.dtype} {tuple(weight.shape)}")
    n, k = weight.shape
    groups = -(-k // block[1])
    if xq.dtype != FP8_DTYPE or xq.dim() != 2 or xq.shape[1] != k or xq.stride(1) != 1:
        raise ValueError(f"xq must be float8_e4m3fn [M, {k}] with unit last stride, got {xq.dtype} "
                         f"{tuple(xq.shape)}")
    m = xq.shape[0]
    if x_scale.dtype != torch.float32 or tuple(x_scale.shape) != (m, groups) or x_scale.stride(1) != 1:
        raise ValueError(f"x_scale must be float32 [{m}, {groups}] (a scale per token and {block[1]}-wide "
                         f"group) with unit last stride, got {x_scale.dtype} {tuple(x_scale.shape)}")
    w_blocks = (-(-n // block[0]), groups)
    if w_scale.dtype != torch.float32 or tuple(w_scale.shape) != w_blocks or w_scale.stride(1) != 1:
        raise ValueError(f"w_scale must be float32 {list(w_blocks)} (a scale per {block[0]} x {block[1]} block) "
                         f"with unit last stride, got {w_scale.dtype} {tuple(w_scale.shape)}")
    if bias is not None and (bias.shape != (n,) or bias.stride(0) != 1):
        raise ValueError(f"bias must be contiguous [{n}], got {tuple(bias.shape)}")
    if out_dtype not in _OUT_DTYPES:
        raise ValueError(f"out_dtype must be bfloat16, float16 or float32, got {out_dtype}")
    tensors = (xq, x_scale, weight, w_scale) if bias is None else (xq, x_scale, weight, w_scale, bias)
    if len({t.device for t in tensors}) != 1:
        raise ValueError(f"xq, x_scale, weight, w_scale and bias must be on one device, got "
                         f"{[str(t.device) for t in tensors]}")


def fp8_block_gemm(xq: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, w_scale: torch.Tensor,
                   block: tuple[int, int], bias: torch.Tensor | None = None, out_dtype: torch.dtype = torch.bfloat16,
                   config: BlockGemmConfig | None = None) -> torch.Tensor:
    """y [M, N] in out_dtype: y[m, n] = sum over K groups g of (q[m, g] . w[n, g]) * x_scale[m, g] *
    w_scale[n // BN, g], accumulated in fp32, + bias, rounded once. xq fp8 [M, K] and x_scale float32
    [M, ceil(K / BK)] from quantize_fp8_groups_*(x, BK); weight fp8 [N, K], w_scale float32
    [ceil(N / BN), ceil(K / BK)]; block = (BN, BK)."""
    _check(xq, x_scale, weight, w_scale, block, bias, out_dtype)
    m, (n, k) = xq.shape[0], weight.shape
    out = torch.empty(m, n, dtype=out_dtype, device=xq.device)
    if m == 0 or n == 0:
        return out
    cfg = config or choose_block_gemm_config(m, n, k, block)
    grid = (triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n),)
    _fp8_block_gemm_kernel[grid](
        out, xq, x_scale, weight, w_scale, bias if bias is not None else w_scale, m, n, k, xq.stride(0),
        x_scale.stride(0), weight.stride(0), w_scale.stride(0), out.stride(0), HAS_BIAS=bias is not None,
        BN=block[0], BLOCK_K=block[1], BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, GROUP_M=cfg.group_m,
        FAST_ACCUM=cfg.fast_accum,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out


def fp8_block_linear(x: torch.Tensor, weight: torch.Tensor, w_scale: torch.Tensor, block: tuple[int, int],
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ W^T + bias -> [..., N] in x's dtype: x quantized per token and BK-wide group
    (one launch), then the block-scaled GEMM (one launch)."""
    if x.dim() == 0 or x.shape[-1] != weight.shape[-1]:
        raise ValueError(f"x must be [..., {weight.shape[-1]}], got {tuple(x.shape)}")
    lead = x.shape[:-1]
    xq, x_scale = quantize_fp8_groups_triton(x.reshape(-1, x.shape[-1]), block[1])
    y = fp8_block_gemm(xq, x_scale, weight, w_scale, block, bias, out_dtype=x.dtype)
    return y.reshape(*lead, weight.shape[0])


_DEQUANTIZE_BAND = 1 << 24  # weights a pass of dequantize_fp8_blocks: 64 MB of float32 temporaries


def dequantize_fp8_blocks(weight: torch.Tensor, w_scale: torch.Tensor, block: tuple[int, int],
                          dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """W [N, K] in `dtype`: weight[n, k] * w_scale[n // BN, k // BK], the product in float32 (torch
    ops: the CPU runner, references). A band of block rows at a time, so the float32 temporaries
    stay small next to a large weight."""
    bn, bk = block
    n, k = weight.shape
    blocks = (-(-n // bn), -(-k // bk))
    if tuple(w_scale.shape) != blocks:
        raise ValueError(f"w_scale must be {list(blocks)} (a scale per {bn} x {bk} block of a [{n}, {k}] weight), "
                         f"got {tuple(w_scale.shape)}")
    out = torch.empty(n, k, dtype=dtype, device=weight.device)
    step = bn * max(1, _DEQUANTIZE_BAND // max(1, bn * k))
    for start in range(0, n, step):
        rows = weight[start:start + step].float()
        s = w_scale[start // bn:(start + step) // bn].float()
        s = s.repeat_interleave(bn, dim=0)[:rows.shape[0]].repeat_interleave(bk, dim=1)[:, :k]
        out[start:start + step] = (rows * s).to(dtype)
    return out
