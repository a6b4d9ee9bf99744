"""int4 products of 2-16 tokens on tensor cores (cuda/int4_gemv.cu, compiled by NVRTC: nvrtc.py).

A decode step of 2-16 requests on an AWQ / GPTQ model: int4_matmul's Triton GEMV runs one program per
token (a Llama-3.1-8B layer's four products: 69 us at one token, 214 us at four) and from 5 tokens its
GEMM dequantizes every weight on CUDA cores per 16-row tile (183 us at eight). This kernel costs about
what one token costs up to 8 tokens (87 us at four, 107 at eight; 171 at sixteen), as the .cu file's
header explains. int4_matmul.int4_linear hands it those batches; one token stays on the Triton GEMV
and its fused one-token path.

It reads its own weight layout (`pack_mma`, built from the codes when an int4 layer is loaded on a GPU
that can run it: layers/quant/int4_pack.py), so an int4 layer holds its codes twice, this layout beside
int4_matmul's (which the other paths read): +0.5 byte per weight.

Taken when `Int4Weights.mma` is set and `supported` agrees: bf16 / fp16 activations, fp16 / bf16 / fp32
scales, K a multiple of 64, groups of 32 or a multiple of 64 dividing K (or one group); and
FERROX_INT4_MMA is not "0" (the switch for A/B runs, read when a layer is built). Everything else
-- the CPU, the Triton interpreter, fp32 activations -- runs the Triton kernels.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import cache, lru_cache

import torch

from ferrox.kernels import nvrtc
from ferrox.kernels.nvrtc import I32, I64, PTR

SOURCE_NAME = "int4_gemv.cu"
_ENV = "FERROX_INT4_MMA"
_ACT = {torch.bfloat16: "Bf16", torch.float16: "F16"}
_SCALE = {torch.float16: "F16", torch.bfloat16: "Bf16", torch.float32: "F32"}
# One token: the Triton GEMV (int4_matmul; faster there, 69 vs 83 us a Llama-3.1-8B layer on the H200). Up to
# 16: the kernel's columns, two MMA tiles of 8.
MIN_TOKENS, MAX_TOKENS = 2, 16


@dataclass(frozen=True, slots=True)
class CudaGemvConfig:
    warps: int  # per block; they split K, each streaming its share of the block's 16-row tile
    stages: int  # 512-byte k tiles a warp keeps in flight (loads issued before the current one converts)


# Every config a call may use is compiled into the module up front (one NVRTC build per dtype pair).
CONFIGS: tuple[CudaGemvConfig, ...] = (CudaGemvConfig(8, 4), CudaGemvConfig(4, 4), CudaGemvConfig(8, 2))


def choose_config(n: int, k: int) -> CudaGemvConfig:
    """8 warps, 4 k tiles in flight each: the best of the first sweep (Llama-3.1-8B's four products, one
    token, H200). At eight tokens 8 warps x 2 tiles measured 6% less a layer (100.9 vs 107.4 us); not the
    default yet, as the end-to-end runs and the live server used this one (benches/RESULTS.md)."""
    return CONFIGS[0]


def kernel_name(act: str, scale: str, column_tiles: int, cfg: CudaGemvConfig) -> str:
    return f"ferrox_int4_mma_{act.lower()}_{scale.lower()}_c{column_tiles}_w{cfg.warps}_p{cfg.stages}"


def module_source(act: str, scale: str, base: str) -> str:
    """The .cu text plus one FERROX_INT4_GEMV line per (token column tiles, config) for this dtype pair."""
    lines = [base]
    for column_tiles in (1, 2):
        for cfg in CONFIGS:
            lines.append(f"FERROX_INT4_GEMV({kernel_name(act, scale, column_tiles, cfg)}, {act}, {scale}, "
                         f"{column_tiles}, {cfg.warps}, {cfg.stages})")
    return "\n".join(lines) + "\n"


# ---- the weight layout -------------------------------------------------------------------------------
# Nibble j of a lane's word of one k16 step holds (row offset, column offset) _NIBBLE_AT[j] relative to
# (g, 2t): the A fragment registers a0..a3 are nibbles (0, 4), (1, 5), (2, 6), (3, 7) (the .cu header).
_NIBBLE_AT = ((0, 0), (8, 0), (0, 8), (8, 8), (0, 1), (8, 1), (0, 9), (8, 9))


def pack_mma(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [N, K] (K a multiple of 64) -> int32 [ceil(N/16), K/64, 32, 4], rows padded with code 0."""
    n, k = codes.shape
    if k % 64:
        raise ValueError(f"the tensor-core int4 layout needs in_features divisible by 64, got {k}")
    tiles = -(-n // 16)
    if tiles * 16 != n:
        codes = torch.cat([codes, codes.new_zeros(tiles * 16 - n, k)])
    lane = torch.arange(32, device=codes.device)
    g, t = lane // 4, lane % 4
    # [32 lanes, 8 nibbles] -> index into a [16 rows x 16 columns] k16 step
    index = torch.stack([(g + dr) * 16 + 2 * t + dc for dr, dc in _NIBBLE_AT], dim=1)
    steps = codes.view(tiles, 16, k // 16, 16).permute(0, 2, 1, 3).reshape(tiles, k // 16, 256)
    nibbles = steps[:, :, index.flatten()].view(tiles, k // 16, 32, 8).to(torch.int64)
    words = (nibbles << (4 * torch.arange(8, device=codes.device))).sum(-1)  # [tiles, k16 steps, 32]
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    return words.view(tiles, k // 64, 4, 32).transpose(2, 3).contiguous()


def layout_supported(n: int, k: int, group: int) -> bool:
    """Whether `pack_mma` and the kernel take a [n, k] weight with this group size."""
    # Warps split K by whole groups (a fold scales one group's sums), so the group divides K; inside a
    # 64-wide k tile only groups of 32 fold twice.
    return k % 64 == 0 and (group >= k or (k % group == 0 and (group % 64 == 0 or group == 32)))


# ---- the module --------------------------------------------------------------------------------------
@lru_cache(maxsize=1)
def _base_source() -> str | None:
    from ferrox.kernels.cuda_sampling import PACKAGED_SOURCE_DIR

    path = PACKAGED_SOURCE_DIR / SOURCE_NAME
    return path.read_text() if path.is_file() else None


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


def supported(x: torch.Tensor, mma: torch.Tensor | None, scales: torch.Tensor,
              bias: torch.Tensor | None) -> bool:
    """Whether the kernel takes this product (the module docstring); the caller checked shapes."""
    # (The token count first: int4_linear asks on every product, one-token ones included.)
    if not MIN_TOKENS <= x.shape[0] <= MAX_TOKENS or mma is None or not x.is_cuda:
        return False
    if x.dtype not in _ACT or scales.dtype not in _SCALE or (bias is not None and bias.dtype != x.dtype):
        return False
    if x.data_ptr() % 4 or x.stride(0) % 2 or x.stride(1) != 1:
        return False  # 4-byte activation loads (pairs)
    return _device_ok(x.device.index if x.device.index is not None else torch.cuda.current_device())


_TYPES = (PTR, PTR, PTR, PTR, PTR, PTR, I32, I32, I32, I32, I64, I64)


def int4_mma_product(x: torch.Tensor, mma: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                     group_size: int, bias: torch.Tensor | None = None,
                     config: CudaGemvConfig | None = None) -> torch.Tensor:
    """x [M, K] @ W.T (+ bias) -> [M, N] in x's dtype, M <= 16, W in `pack_mma`'s layout (N = scales' rows)."""
    m, k = x.shape
    n = scales.shape[0]
    cfg = config or choose_config(n, k)
    act, scale = _ACT[x.dtype], _SCALE[scales.dtype]
    fn = _module(act, scale).function(x.device, kernel_name(act, scale, 1 if m <= 8 else 2, cfg))
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    args = (out.data_ptr(), x.data_ptr(), mma.data_ptr(), scales.data_ptr(), zeros.data_ptr(),
            bias.data_ptr() if bias is not None else 0, m, n, k, min(group_size, k), x.stride(0), out.stride(0))
    nvrtc.launch(fn, -(-n // 16), 32 * cfg.warps, args, _TYPES, torch.cuda.current_stream(x.device).cuda_stream)
    return out
