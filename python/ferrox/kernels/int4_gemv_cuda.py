"""int4 decode products (1-16 tokens) on tensor cores: cuda/int4_gemv.cu, compiled by NVRTC (nvrtc.py).

A decode step reads each weight once, so its products should cost the weight bytes over the read
bandwidth whatever the number of requests. int4_matmul's Triton GEMV runs one program per token (a
Llama-3.1-8B layer's four products: 69 us at one token, 214 us at four) and from 5 tokens its GEMM
dequantizes every weight on CUDA cores per 16-row tile (181 us at eight). This kernel: 48 us a layer
at one token, 66 at sixteen; the fused one-token layer 51 us against the Triton GEMV's 76 (H200,
benches/RESULTS.md; the .cu header says how). int4_matmul.int4_linear hands it every product of 1-16
tokens, and int4_gemv the fused one-token path's (attention/fused_decode.py): the input RMSNorm in
the loop, silu(gate) * up and the residual in the epilogue.

It reads its own stream (`pack_mma`, built when an int4 layer is loaded on a GPU that can run it:
layers/quant/int4_pack.py): the codes in MMA fragment order with each group's scales and zero points
beside them. The layer keeps int4_matmul's layout too (prefill and batches above 16 read it): +0.53 byte
per weight at group 128.

Taken when `Int4Weights.mma` is set and `supported` agrees: bf16 / fp16 activations, fp16 / bf16 scales,
K a multiple of 64, groups of a multiple of 64 dividing K (or one group), zero points up to 16; and
FERROX_INT4_MMA is not "0" (the switch for A/B runs, read when a layer is built). Everything else -- the
CPU, the Triton interpreter, fp32 activations or scales, groups of 32 -- runs the Triton kernels.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import cache
from typing import TYPE_CHECKING

import torch

from ferrox.kernels import nvrtc
from ferrox.kernels.nvrtc import F32, I32, I64, PTR, U32
from ferrox.kernels.pdl import pdl_enabled

if TYPE_CHECKING:
    from ferrox.kernels.int4_matmul import Int4Weights

SOURCE_NAME = "int4_gemv.cu"
_ENV = "FERROX_INT4_MMA"
_ACT = {torch.bfloat16: "Bf16", torch.float16: "F16"}
_SCALE = {torch.float16: "F16", torch.bfloat16: "Bf16"}  # kept in the stream's 16-bit metadata
MIN_TOKENS, MAX_TOKENS = 1, 16  # up to 16: the kernel's columns, two MMA tiles of 8
NORM_MAX_TOKENS = 8  # the norm's statistic is read off one column tile

# The fusions (the .cu's Fuse flags) the one-token path asks for: qkv (norm), o_proj and down (residual),
# gate_up (norm, silu(gate) * up).
NORM, SILU_MUL, RESIDUAL = 1, 2, 4
FUSIONS = (NORM, RESIDUAL, NORM | SILU_MUL)


@dataclass(frozen=True, slots=True)
class CudaGemvConfig:
    warps: int  # per block; they split K, each streaming its share of the block's row tiles
    stages: int  # 512-byte k tiles a warp keeps in flight (loads issued before the current one converts)


# Every config a call may use is compiled into the module up front (one NVRTC build per dtype pair).
# One k tile in flight per warp beat two or four everywhere on the H200 (fewer registers, more blocks an
# SM: gate_up 24.6 us at 8 warps x 1, 27.7 at 8 x 2, 33.2 at 8 x 4); the best warps per block depend on
# how many 16-row tiles the product has (`choose_config`; benches/RESULTS.md).
CONFIGS: tuple[CudaGemvConfig, ...] = (CudaGemvConfig(8, 1), CudaGemvConfig(16, 1), CudaGemvConfig(4, 1))
_FEW_TILES, _SOME_TILES = 264, 512  # (an H200 has 132 SMs)


def choose_config(row_tiles: int, column_tiles: int = 1, norm: bool = False) -> CudaGemvConfig:
    """Warps per block by the grid's size (Llama-3.1-8B, one token, H200, us): a narrow product (4096
    rows, 256 tiles) takes 16 (o_proj 5.3 against 6.6 with 8; down 12.1 against 16.5), or 8 for 9-16
    tokens (down 17.6 against 20.9); qkv (384 tiles) 8 (7.2 against 10.1 with 4), or 4 with the norm
    fused (10.4 against 11.5) or 9-16 tokens; wide ones (gate_up: 1,792 tiles, or 896 gate tiles with
    silu(gate) * up) 4 (23.3 against 24.6 with 8; fused 25.8 against 28.0)."""
    if row_tiles < _FEW_TILES:
        return CudaGemvConfig(16 if column_tiles == 1 else 8, 1)
    if row_tiles < _SOME_TILES and column_tiles == 1 and not norm:
        return CudaGemvConfig(8, 1)
    return CudaGemvConfig(4, 1)


def kernel_name(act: str, scale: str, column_tiles: int, cfg: CudaGemvConfig, fuse: int = 0) -> str:
    return f"ferrox_int4_mma_{act.lower()}_{scale.lower()}_c{column_tiles}_w{cfg.warps}_p{cfg.stages}_f{fuse}"


def module_source(act: str, scale: str, base: str) -> str:
    """The .cu text plus one FERROX_INT4_GEMV line per kernel this dtype pair can launch."""
    variants = [(column_tiles, cfg, 0) for column_tiles in (1, 2) for cfg in CONFIGS]
    variants += [(1, cfg, fuse) for fuse in FUSIONS for cfg in CONFIGS]
    lines = [base]
    for column_tiles, cfg, fuse in variants:
        lines.append(f"FERROX_INT4_GEMV({kernel_name(act, scale, column_tiles, cfg, fuse)}, {act}, {scale}, "
                     f"{column_tiles}, {cfg.warps}, {cfg.stages}, {fuse})")
    return "\n".join(lines) + "\n"


# ---- the weight layout -------------------------------------------------------------------------------
# Nibble j of a lane's word of one k16 step holds (row offset, MMA column offset) _NIBBLE_AT[j] relative
# to (g, 2t): the A fragment registers a0..a3 are nibbles (0, 4), (1, 5), (2, 6), (3, 7) (the .cu header).
_NIBBLE_AT = ((0, 0), (8, 0), (0, 8), (8, 8), (0, 1), (8, 1), (0, 9), (8, 9))


def mma_column_k() -> torch.Tensor:
    """[4 steps, 16 MMA columns] -> k within a 64-wide tile: step s, column 2t + i is k = 16t + 4s + i and
    column 2t + 8 + i is k = 16t + 4s + 2 + i (i < 2), so lane t's activations for a whole tile are 16
    consecutive ones (the .cu header)."""
    s = torch.arange(4)[:, None]
    c = torch.arange(16)[None, :]
    return 16 * ((c % 8) // 2) + 4 * s + 2 * (c // 8) + c % 2


def pack_mma(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int) -> torch.Tensor:
    """uint8 codes [N, K], scales (fp16 / bf16) and uint8 zeros [N, G] -> the kernel's stream, int32
    [ceil(N/16), G, K/64/G * 128 + 16]: per row tile and group, the group's k tiles ([32 lanes][4 words]
    each) then its metadata ([8][2] words: scale bits << 16 | zero). Rows padded with code 0, scale 0."""
    n, k = codes.shape
    group = min(group, k)
    problem = stream_problem(n, k, group, scales, zeros)
    if problem is not None:
        raise ValueError(problem)
    groups = k // group
    if scales.shape != (n, groups) or zeros.shape != (n, groups):
        raise ValueError(f"scales {tuple(scales.shape)} / zeros {tuple(zeros.shape)} for a [{n}, {k}] weight "
                         f"in groups of {group}: expected [{n}, {groups}]")
    tiles = -(-n // 16)
    pad = tiles * 16 - n
    if pad:
        codes = torch.cat([codes, codes.new_zeros(pad, k)])
        scales = torch.cat([scales, scales.new_zeros(pad, groups)])
        zeros = torch.cat([zeros, zeros.new_zeros(pad, groups)])
    dev = codes.device
    # Columns in MMA order: tile kt, step s, column c holds k = 64 kt + mma_column_k()[s, c].
    codes = codes.view(-1, k // 64, 64)[:, :, mma_column_k().flatten().to(dev)].reshape(-1, k)
    lane = torch.arange(32, device=dev)
    g, t = lane // 4, lane % 4
    # [32 lanes, 8 nibbles] -> index into a [16 rows x 16 columns] k16 step
    index = torch.stack([(g + dr) * 16 + 2 * t + dc for dr, dc in _NIBBLE_AT], dim=1)
    steps = codes.view(tiles, 16, k // 16, 16).permute(0, 2, 1, 3).reshape(tiles, k // 16, 256)
    nibbles = steps[:, :, index.flatten()].view(tiles, k // 16, 32, 8).to(torch.int64)
    words = (nibbles << (4 * torch.arange(8, device=dev))).sum(-1)  # [tiles, k16 steps, 32]
    words = words.view(tiles, k // 64, 4, 32).transpose(2, 3).reshape(tiles, groups, -1)
    bits = scales.contiguous().view(torch.int16).to(torch.int64) & 0xFFFF
    meta = (bits << 16) | zeros.to(torch.int64)  # [rows, G]
    meta = meta.view(tiles, 2, 8, groups).permute(0, 3, 2, 1).reshape(tiles, groups, 16)  # [g][rows g, g + 8]
    stream = torch.cat([words, meta], dim=2)
    return torch.where(stream >= 2**31, stream - 2**32, stream).to(torch.int32).contiguous()


def stream_problem(n: int, k: int, group: int, scales: torch.Tensor, zeros: torch.Tensor) -> str | None:
    """Why `pack_mma` cannot hold this weight (its shape, group size, scale dtype or zero points), or None."""
    if not layout_supported(n, k, group):
        return (f"the tensor-core int4 layout needs in_features ({k}) divisible by 64 and groups ({group}) of a "
                "multiple of 64 that divide it")
    if scales.dtype not in _SCALE:
        return f"the tensor-core int4 layout keeps 16-bit scales, got {scales.dtype}"
    top = int(zeros.max())
    if top > 16:
        return f"int4 zero points above 16 ({top}) do not fit the kernel's metadata"
    return None


def layout_supported(n: int, k: int, group: int) -> bool:
    """Whether `pack_mma` and the kernel take a [n, k] weight with this group size."""
    # A group is whole k tiles (64 k): its metadata follows its last one.
    return k % 64 == 0 and (group >= k or (k % group == 0 and group % 64 == 0))


# ---- the module --------------------------------------------------------------------------------------
def _base_source() -> str | None:
    return nvrtc.packaged_source(SOURCE_NAME)


@cache
def _module(act: str, scale: str) -> nvrtc.CudaModule:
    base = _base_source()
    assert base is not None
    return nvrtc.CudaModule(f"int4_gemv_{act.lower()}_{scale.lower()}", module_source(act, scale, base))


@cache
def _device_ok(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 8  # mma.sync bf16 and the bf16 conversions


def enabled() -> bool:
    """The switch and the prerequisites; checked when an int4 layer decides whether to pack this layout."""
    return (os.environ.get(_ENV, "1") != "0" and os.environ.get("TRITON_INTERPRET") != "1"
            and nvrtc.bindings() is not None and _base_source() is not None)


def supported(x: torch.Tensor, mma: torch.Tensor | None, scales: torch.Tensor, bias: torch.Tensor | None, *,
              norm_weight: torch.Tensor | None = None, silu_mul: bool = False,
              residual: torch.Tensor | None = None) -> bool:
    """Whether the kernel takes this product (the module docstring); the caller checked shapes."""
    # (The token count first: int4_linear asks on every product.)
    if not MIN_TOKENS <= x.shape[0] <= MAX_TOKENS or mma is None or not x.is_cuda:
        return False
    if x.dtype not in _ACT or scales.dtype not in _SCALE or (bias is not None and bias.dtype != x.dtype):
        return False
    if x.data_ptr() % 16 or x.stride(0) % 8 or x.stride(1) != 1:
        return False  # 16-byte activation loads
    if norm_weight is not None and residual is not None:
        return False  # not a fusion the one-token path asks for (FUSIONS), so not compiled
    if norm_weight is not None and (x.shape[0] > NORM_MAX_TOKENS or norm_weight.dtype != x.dtype
                                    or norm_weight.data_ptr() % 16 or norm_weight.stride(0) != 1):
        return False
    if silu_mul and scales.shape[0] % 32:
        return False  # a block owns a 16-row tile of gate and the matching one of up
    if residual is not None and (residual.dtype != x.dtype or residual.stride(1) != 1):
        return False
    return _device_ok(x.device.index if x.device.index is not None else torch.cuda.current_device())


_TYPES = (PTR, PTR, PTR, PTR, I32, I32, I32, I32, I64, I64, U32, PTR, F32, PTR, I64)
# The nibble mask, passed as an argument: as a literal, ptxas re-materialises it before every LOP3 (one
# IMAD.MOV per fragment register, ~13 instructions a k tile).
_NIBBLE_MASK = 0x000F000F


def int4_mma_product(x: torch.Tensor, w: Int4Weights, bias: torch.Tensor | None = None,
                     config: CudaGemvConfig | None = None, *, norm_weight: torch.Tensor | None = None,
                     eps: float = 1e-6, silu_mul: bool = False, residual: torch.Tensor | None = None,
                     pdl: bool | None = None) -> torch.Tensor:
    """x [M, K] @ W.T (+ bias) -> [M, N] in x's dtype, M <= 16, for a weight carrying `pack_mma`'s stream;
    with int4_gemv's fusions (norm_weight: rms_norm(x) * norm_weight first; silu_mul: W's rows are
    [gate | up] and the result silu(gate) * up, [M, N / 2]; residual [M, N_out] added last). pdl: launch
    with programmatic dependent launch (None: where kernels/pdl.py enables it; the kernel requests its
    first weight tiles before it waits for the previous kernel)."""
    assert w.mma is not None
    m, k = x.shape
    n = w.scales.shape[0] // (2 if silu_mul else 1)
    fuse = ((NORM if norm_weight is not None else 0) | (SILU_MUL if silu_mul else 0)
            | (RESIDUAL if residual is not None else 0))
    column_tiles = 1 if m <= 8 else 2
    cfg = config or choose_config(-(-n // 16), column_tiles, norm_weight is not None)
    act, scale = _ACT[x.dtype], _SCALE[w.scales.dtype]
    fn = _module(act, scale).function(x.device, kernel_name(act, scale, column_tiles, cfg, fuse))
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    args = (out.data_ptr(), x.data_ptr(), w.mma.data_ptr(), bias.data_ptr() if bias is not None else 0, m, n, k,
            min(w.group_size, k), x.stride(0), out.stride(0), _NIBBLE_MASK,
            norm_weight.data_ptr() if norm_weight is not None else 0, eps,
            residual.data_ptr() if residual is not None else 0, residual.stride(0) if residual is not None else 0)
    nvrtc.launch(fn, -(-n // 16), 32 * cfg.warps, args, _TYPES, torch.cuda.current_stream(x.device).cuda_stream,
                 pdl=pdl_enabled(x.device) if pdl is None else pdl)
    return out
