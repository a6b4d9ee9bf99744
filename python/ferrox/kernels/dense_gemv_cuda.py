"""Decode products (1-8 tokens) on tensor cores for weights kept as they load: cuda/dense_gemv.cu, compiled
by NVRTC (nvrtc.py).

A decode step reads each weight once, so a product should cost its weight bytes over the read bandwidth.
gemv.py's Triton GEMV widens every weight on CUDA cores (bf16: 3.4-4.4 TB/s on an H200 at Llama-3.1-8B's
shapes, the narrow products slowest), and w8a8_dot_gemv.py's FP8 product runs warpgroup MMAs over
64-128-row programs that split K to fill the GPU (1.9-3.6 TB/s). This kernel gives each tile of 16 rows
to mma.sync straight from the layer's own [N, K] weight (the .cu header says how): bf16 / fp16 weights
against the activations, E4M3 weights against the token's fp8 codes (W8A8: quantized per token in the
prologue, or by the static input scale, as `w8a8_dot_gemv` quantizes it). The one-token path's fusions
ride along: the input RMSNorm, silu(gate) * up, the residual, rotary + the KV-cache write, fp32 logits.
Measured (benches/RESULTS.md): FP8 qkv 13.2 -> 9.7 us, o_proj 8.0 -> 6.3, gate_up 33.0 -> 32.2, down
20.7 -> 17.6; bf16 o_proj 9.8 -> 8.7, down 28.3 -> 27.8, the LM head 239 -> 232.

`gemv.gemv`, `gemv.qkv_rope_gemv` and `w8a8_dot_gemv.w8a8_dot_gemv` hand it every call `supported` /
`qkv_rope_supported` accept (their contracts are this module's): FP8 W8A8 products of every kind --
per-row scales, and block-wise checkpoints with 128-input groups (BLOCK_SCALES: each group's MMA sums
folded in times its token and weight scales) --, and 16-bit products but norm + SiLU (and qkv + rotary
into an E4M3 cache; FUSIONS_16 says why). Everything else -- the CPU, the Triton interpreter, fp32
activations, fp8 weight-only layers, other block shapes, int8 -- keeps the Triton kernels. Linear layers
hand it their batches of a few rows (`few_token_product`) in place of cuBLAS. FERROX_DENSE_MMA=0 turns it off,
FERROX_DENSE_MMA_ROWS=1 only for batches (A/B runs).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import cache

import torch

from ferrox.kernels import nvrtc
from ferrox.kernels.nvrtc import F32, I32, I64, PTR
from ferrox.kernels.pdl import pdl_enabled

SOURCE_NAME = "dense_gemv.cu"
_ENV = "FERROX_DENSE_MMA"
_ROWS_ENV = "FERROX_DENSE_MMA_ROWS"
_ACT = {torch.bfloat16: "Bf16", torch.float16: "F16"}
FP8 = torch.float8_e4m3fn
MAX_TOKENS = 8  # one MMA column tile
UNIT_BYTES = 64  # a row's bytes per unit: four lanes x 16 (the .cu header)
# The staged tokens share a block's shared memory with the warps' rings (`supported` checks the sum against
# the GPU's limit for the config the launch will take): 8 FP8 tokens of Llama-3.1-8B's down_proj input are
# 112 KB, 4 in bf16 the same.

# The .cu's Fuse flags. The one-token path asks for qkv (norm, rotary and the KV write into a 16-bit or
# E4M3 cache; the norm alone where Qwen3's q/k norms follow), o_proj and down (residual), gate_up (norm,
# silu(gate) * up); the LM head and the MoE router for fp32 out (the router with the norm). 16-bit weights
# leave gate_up to gemv.py's Triton kernel, which measured faster there (Llama-3.1-8B, H200: 54.7 against
# 55.8 us), and take qkv + rotary into a cache of their own dtype (batch-1 step 3.87 against 3.89 ms on
# Triton; benches/RESULTS.md); an E4M3 cache behind 16-bit weights stays on Triton.
NORM, SILU_MUL, RESIDUAL, OUT_F32, ROPE, KV_FP8, BLOCK_SCALES = 1, 2, 4, 8, 16, 32, 64
FUSIONS_FP8 = (0, NORM, RESIDUAL, NORM | SILU_MUL, ROPE | NORM, ROPE | NORM | KV_FP8)
FUSIONS_16 = (0, NORM, RESIDUAL, OUT_F32, NORM | OUT_F32, ROPE | NORM)
# Block-wise FP8 checkpoints (128-input groups), in a module of their own (only their models compile it):
# the one-token path's qkv (the norm; rotary runs after Qwen3-style per-head norms), o_proj and down
# (residual), gate_up (norm + SiLU), and plain products for batches.
FUSIONS_FP8_BLOCK = (BLOCK_SCALES, BLOCK_SCALES | NORM, BLOCK_SCALES | RESIDUAL, BLOCK_SCALES | NORM | SILU_MUL)
GROUP = 128  # a block-wise checkpoint's input group (the kernel's BLOCK_SCALES)


@dataclass(frozen=True, slots=True)
class DenseGemvConfig:
    warps: int  # per block; they take the row's stages in turn
    chunks: int  # 64-byte units of each row a warp loads per stage
    stages: int  # the depth of each warp's shared-memory ring (stages - 1 in flight)

    def ring_bytes(self, pairs: bool) -> int:
        """Shared memory for the warps' rings (pairs: two row tiles a block, SILU_MUL or ROPE)."""
        return self.warps * self.stages * (2 if pairs else 1) * 2 * self.chunks * 512


CONFIGS: tuple[DenseGemvConfig, ...] = (DenseGemvConfig(16, 2, 2), DenseGemvConfig(8, 2, 3), DenseGemvConfig(8, 4, 2))
_FEW_TILES = 264  # (an H200 has 132 SMs)
_LM_HEAD_TILES = 1024  # 16-bit products this long (vocabularies) stream best in four-unit stages


def choose_config(row_tiles: int, kbytes: int, fp8: bool = False) -> DenseGemvConfig:
    """From `bench_dense_gemv.py --sweep` on an H200 (Llama-3.1-8B, benches/RESULTS.md): few row tiles
    (o_proj, down: 256) take 16 warps a block over two-unit stages (fp8 o_proj 6.3 us, down 17.6; bf16
    8.7, 27.8); more take 8 warps over three two-unit stages (fp8 qkv + rotary 10.0, gate_up 32.2; 16-bit
    qkv, where engine steps measured it against 8 x 4 x 2: Llama-3.1-8B 3.88 against 3.93 ms, Qwen3-30B-A3B
    2.44 against 2.45), but 16-bit products of vocabulary length two four-unit stages (the LM head 232
    us). Where a stage does not divide a row's bytes, one-unit stages."""
    if row_tiles < _FEW_TILES:
        cfg = CONFIGS[0]
    else:
        cfg = CONFIGS[1] if fp8 or row_tiles < _LM_HEAD_TILES else CONFIGS[2]
    if kbytes % (UNIT_BYTES * cfg.chunks):
        cfg = DenseGemvConfig(cfg.warps, 1, cfg.stages)
    return cfg


def kernel_name(act: str, fp8: bool, cfg: DenseGemvConfig, fuse: int) -> str:
    return f"ferrox_dense_{act.lower()}_{'e4m3' if fp8 else 'w16'}_w{cfg.warps}_c{cfg.chunks}_s{cfg.stages}_f{fuse}"


def _fusions(fp8: bool, block: bool) -> tuple[int, ...]:
    return FUSIONS_FP8_BLOCK if block else FUSIONS_FP8 if fp8 else FUSIONS_16


def module_source(act: str, fp8: bool, base: str, configs: tuple[DenseGemvConfig, ...] = CONFIGS,
                  block: bool = False) -> str:
    """The .cu text plus one FERROX_DENSE_GEMV line per kernel this dtype pair (block: block-scaled FP8)
    can launch."""
    lines = [base]
    for cfg in configs:
        for fuse in _fusions(fp8, block):
            lines.append(f"FERROX_DENSE_GEMV({kernel_name(act, fp8, cfg, fuse)}, {act}, {str(fp8).lower()}, "
                         f"{cfg.warps}, {cfg.chunks}, {cfg.stages}, {fuse})")
    return "\n".join(lines) + "\n"


def _base_source() -> str | None:
    return nvrtc.packaged_source(SOURCE_NAME)


@cache
def _module(act: str, fp8: bool, configs: tuple[DenseGemvConfig, ...] = CONFIGS, block: bool = False) -> nvrtc.CudaModule:
    base = _base_source()
    assert base is not None
    suffix = ("_block" if block else "") + ("" if configs == CONFIGS else f"_{abs(hash(configs)) % 10**8}")
    return nvrtc.CudaModule(f"dense_gemv_{act.lower()}_{'e4m3' if fp8 else 'w16'}{suffix}",
                            module_source(act, fp8, base, configs, block))


@cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def enabled() -> bool:
    """The switch and the prerequisites (read on every call: tests and A/B runs flip the switch)."""
    return (os.environ.get(_ENV, "1") != "0" and os.environ.get("TRITON_INTERPRET") != "1"
            and nvrtc.bindings() is not None and _base_source() is not None)


def _aligned(t: torch.Tensor) -> bool:
    return t.data_ptr() % 16 == 0 and t.stride(-1) == 1 and (t.dim() == 1 or t.shape[0] == 1
                                                            or t.stride(0) * t.element_size() % 16 == 0)


def supported(x: torch.Tensor, weight: torch.Tensor, *, weight_scale: torch.Tensor | None = None,
              bias: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None,
              residual: torch.Tensor | None = None, silu_mul: bool = False, input_scale: torch.Tensor | None = None,
              out_dtype: torch.dtype | None = None, block: tuple[int, int] | None = None) -> bool:
    """Whether the kernel takes this product (the callers checked shapes): a [M <= 8, K] CUDA input in
    bf16 / fp16, and a weight in that dtype or (W8A8) E4M3 with float32 row scales -- or, with block =
    (BN, BK), block scales [ceil(N / BN), K / BK] with BK 128 and BN a multiple of 16 --, laid out for
    16-byte loads; the fusions compiled for its kind."""
    if not x.is_cuda or x.dim() != 2 or not 1 <= x.shape[0] <= MAX_TOKENS or x.dtype not in _ACT:
        return False
    fp8 = weight.dtype == FP8
    if not fp8 and (weight.dtype != x.dtype or weight_scale is not None or input_scale is not None):
        return False
    if block is not None:
        bn, bk = block
        if (not fp8 or bk != GROUP or bn % 16 or input_scale is not None or weight_scale is None
                or weight_scale.dtype != torch.float32 or not weight_scale.is_contiguous() or x.shape[1] % GROUP
                or weight_scale.shape != (-(-weight.shape[0] // bn), x.shape[1] // GROUP)):
            return False
    elif fp8 and (weight_scale is None or weight_scale.dtype != torch.float32 or not weight_scale.is_contiguous()
                  or weight_scale.shape != weight.shape[:1]):
        return False
    if input_scale is not None and (input_scale.dtype != torch.float32 or input_scale.numel() != 1):
        return False
    k = x.shape[1]
    kbytes = k * weight.element_size()
    if weight.dim() != 2 or weight.shape[1] != k or kbytes % UNIT_BYTES:
        return False
    if not (_aligned(x) and _aligned(weight)):
        return False
    fuse = ((NORM if norm_weight is not None else 0) | (SILU_MUL if silu_mul else 0)
            | (RESIDUAL if residual is not None else 0)
            | (OUT_F32 if out_dtype == torch.float32 and x.dtype != torch.float32 else 0))
    if block is not None:
        fuse |= BLOCK_SCALES
    if out_dtype not in (None, x.dtype, torch.float32) or fuse not in _fusions(fp8, block is not None):
        return False
    if silu_mul and weight.shape[0] % 2:
        return False
    for t in (bias, norm_weight, residual):
        if t is not None and t.dtype != x.dtype:
            return False
    if norm_weight is not None and not _aligned(norm_weight):
        return False
    if residual is not None and residual.stride(-1) != 1:
        return False
    if bias is not None and not bias.is_contiguous():
        return False
    if not enabled():
        return False
    index = x.device.index if x.device.index is not None else torch.cuda.current_device()
    if _capability(index) < ((8, 9) if fp8 else (8, 0)):  # E4M3 mma.sync from Ada on; bf16 from Ampere
        return False
    # The staged tokens (and group scales) beside the rings of the config the launch takes.
    n_out = weight.shape[0] // (2 if silu_mul else 1)
    cfg = choose_config(-(-n_out // 16), kbytes, fp8)
    scales = x.shape[0] * (k // GROUP) * 4 if block is not None else 0
    return _shared_bytes(cfg, x.shape[0] * kbytes, silu_mul, scales) <= _shared_optin(index)


# The most rows a batched product hands this kernel, by weight kind. Measured on an H200 (Llama-3.1-8B,
# benches/bench_small_batch.py, benches/RESULTS.md): decode steps of 2 / 4 / 8 requests against cuBLAS,
# bf16 1.14x / 1.06x / 1.01x, FP8 1.55x / 1.34x / 0.97x (decode batches of 5-8 run in the graph of 8).
# Since the prologue's Markstein division and the shared-memory check that lets 8 FP8 tokens of a
# 14336-input product in, FP8 batch 8 measured 1.18x on the kernel too.
_BATCH_ROWS = {False: MAX_TOKENS, True: MAX_TOKENS}


def batch_rows(fp8: bool) -> int:
    """The most rows a batched product (`few_token_product`: 2+ rows, no fusions) of this weight kind
    hands the kernel: _BATCH_ROWS, or FERROX_DENSE_MMA_ROWS for both kinds (1 leaves every batch to
    cuBLAS: A/B runs). Read when a product is issued, so an engine takes it at start-up, when its CUDA
    graphs are captured."""
    env = os.environ.get(_ROWS_ENV)
    if not env:
        return _BATCH_ROWS[fp8]
    if not env.isdigit():
        raise ValueError(f"{_ROWS_ENV} must be a whole number of rows (1 keeps batches on cuBLAS), got {env!r}")
    return min(MAX_TOKENS, int(env))


def few_token_product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                      weight_scale: torch.Tensor | None = None,
                      input_scale: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
                      block: tuple[int, int] | None = None) -> torch.Tensor | None:
    """A linear layer's product for a batch of 2 to `batch_rows()` rows x [M, K] (decode batches of a few
    requests, speculative verify steps, short prompts), or None where the kernel does not take it (the
    caller runs cuBLAS). Why: cuBLAS(Lt) runs a few-row product as a GEMM tiled for many rows (and FP8
    through a separate quantizing launch first), while this kernel streams the weight at about the
    one-token rate for up to 8 tokens (an MMA's n columns; `batch_rows` says how many it takes) and,
    under PDL, starts reading it before the previous kernel ends. bf16 / fp16 weights in x's dtype, or
    E4M3 with float32 row scales against x's per-token codes (input_scale: a static or tensor-wide scale
    instead; block (BN, 128): block scales, x quantized per group); out_dtype float32 for logits."""
    if not 2 <= x.shape[0] <= batch_rows(weight.dtype == FP8) or not x.is_cuda:
        return None
    x = x.contiguous()
    if not supported(x, weight, weight_scale=weight_scale, bias=bias, input_scale=input_scale, out_dtype=out_dtype,
                     block=block):
        return None
    return dense_mma_product(x, weight, bias, weight_scale=weight_scale, input_scale=input_scale,
                             out_dtype=out_dtype, block=block)


def _shared_bytes(cfg: DenseGemvConfig, token_bytes: int, pairs: bool, scale_bytes: int = 0) -> int:
    """The launch's dynamic shared memory: the staged tokens, their group scales (block-scaled FP8), the
    warps' rings and the epilogue's partial sums [warps][row tiles x 16][8] fp32."""
    return (-(-token_bytes // 16) * 16 + -(-scale_bytes // 16) * 16 + cfg.ring_bytes(pairs)
            + cfg.warps * (2 if pairs else 1) * 16 * 8 * 4)


def _grid(fn: object, cfg: DenseGemvConfig, shared: int, tiles: int, device: torch.device) -> int:
    """Persistent blocks: as many as fit on the GPU at once, then as few as keep every block's share of the
    tiles equal (896 tiles on room for 396 blocks: 299 blocks of 3 tiles, not 3 rounds of which the last
    runs a quarter full)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if shared > _shared_optin(index):
        raise ValueError(f"{cfg} needs {shared} bytes of shared memory a block; the GPU allows "
                         f"{_shared_optin(index)}")
    nvrtc.allow_shared(fn, shared)
    room = _blocks_per_sm(fn, 32 * cfg.warps, shared) * _num_sms(index)
    per_block = -(-tiles // max(1, room))
    return -(-tiles // per_block)


@cache
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


@cache
def _shared_optin(index: int) -> int:
    return int(torch.cuda.get_device_properties(index).shared_memory_per_block_optin) - 2048  # (static reductions)


_occupancy: dict[tuple[int, int, int], int] = {}


def _blocks_per_sm(fn: object, threads: int, shared: int) -> int:
    key = (int(fn), threads, shared)  # type: ignore[call-overload]
    if key not in _occupancy:
        _occupancy[key] = max(1, nvrtc.blocks_per_sm(fn, threads, shared))
    return _occupancy[key]


_TYPES = (PTR, PTR, PTR, PTR, PTR, I32, I32, I32, I32, I64, I64, I64, PTR, F32, PTR, PTR, I64,
          PTR, PTR, PTR, PTR, I32, I32, I32, I32, I64, I64, I64, I64, I32, I64)
_NO_KV_WRITE = (0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)  # (rope, slot, cache, kv_scale, half, ..., strides)


def dense_mma_product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                      weight_scale: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None,
                      eps: float = 1e-6, silu_mul: bool = False, residual: torch.Tensor | None = None,
                      input_scale: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
                      block: tuple[int, int] | None = None, config: DenseGemvConfig | None = None,
                      pdl: bool | None = None) -> torch.Tensor:
    """y = W @ rms_norm(x) (+ bias) [-> silu(gate) * up] [+ residual] for x [M, K], M <= 8, in x's dtype
    (or float32 out): gemv.gemv's contract. An E4M3 weight comes with weight_scale (float32 [N]) and
    multiplies x's fp8 codes, per token at absmax / 448 or at input_scale (w8a8_dot_gemv's contract);
    with block (BN, 128), weight_scale holds the block scales and x is quantized per group of 128 inputs.
    pdl: launch with programmatic dependent launch (None: where kernels/pdl.py enables it). The caller
    checked `supported`."""
    m, k = x.shape
    fp8 = weight.dtype == FP8
    n = weight.shape[0] // (2 if silu_mul else 1)
    out_f32 = out_dtype == torch.float32
    fuse = ((NORM if norm_weight is not None else 0) | (SILU_MUL if silu_mul else 0)
            | (RESIDUAL if residual is not None else 0) | (OUT_F32 if out_f32 else 0)
            | (BLOCK_SCALES if block is not None else 0))
    kbytes = k * weight.element_size()
    row_tiles = -(-n // 16)
    cfg = config or choose_config(row_tiles, kbytes, fp8)
    if kbytes % (UNIT_BYTES * cfg.chunks):
        raise ValueError(f"config {cfg}: a stage of {UNIT_BYTES * cfg.chunks} bytes does not divide a row's "
                         f"{kbytes}")
    out = torch.empty(m, n, dtype=torch.float32 if out_f32 else x.dtype, device=x.device)
    shared = _shared_bytes(cfg, m * kbytes, silu_mul, m * (k // GROUP) * 4 if block is not None else 0)
    args = (out.data_ptr(), x.data_ptr(), weight.data_ptr(), weight_scale.data_ptr() if weight_scale is not None else 0,
            bias.data_ptr() if bias is not None else 0, m, n, k, row_tiles, x.stride(0), weight.stride(0) * weight.element_size(),
            out.stride(0), norm_weight.data_ptr() if norm_weight is not None else 0, eps,
            input_scale.data_ptr() if input_scale is not None else 0,
            residual.data_ptr() if residual is not None else 0, residual.stride(0) if residual is not None else 0,
            *_NO_KV_WRITE, block[0] if block is not None else 0,
            weight_scale.stride(0) if block is not None and weight_scale is not None else 0)
    _launch(x, fp8, block is not None, cfg, fuse, row_tiles, shared, args, pdl)
    return out


def _launch(x: torch.Tensor, fp8: bool, block: bool, cfg: DenseGemvConfig, fuse: int, tiles: int, shared: int,
            args: tuple, pdl: bool | None) -> None:
    """The kernel of (x's dtype, fp8, block, cfg, fuse) -- its module compiled or loaded on first use --
    launched on x's stream over a persistent grid for `tiles`, with `shared` bytes of dynamic shared
    memory (pdl None: where kernels/pdl.py enables it)."""
    act = _ACT[x.dtype]
    module = _module(act, fp8, CONFIGS if cfg in CONFIGS else (cfg,), block)
    fn = module.function(x.device, kernel_name(act, fp8, cfg, fuse))
    grid = _grid(fn, cfg, shared, tiles, x.device)
    nvrtc.launch(fn, grid, 32 * cfg.warps, args, _TYPES, torch.cuda.current_stream(x.device).cuda_stream,
                 pdl=pdl_enabled(x.device) if pdl is None else pdl, shared=shared)


def qkv_rope_supported(x: torch.Tensor, weight: torch.Tensor, *, weight_scale: torch.Tensor | None,
                       bias: torch.Tensor | None, norm_weight: torch.Tensor | None, slot_mapping: torch.Tensor,
                       kv_cache: torch.Tensor, head_dim: int, w8a8: bool, input_scale: torch.Tensor | None) -> bool:
    """Whether `dense_qkv_rope` takes gemv.qkv_rope_gemv's call (which checked the shapes): one token,
    the norm, rotary halves of whole 8-pair tiles, an int64 slot, and either an E4M3 weight with its
    input quantized too (W8A8) and a cache in the activation dtype or E4M3, or a weight and a cache in
    the activation dtype (weight-only fp8 weights, and 16-bit ones over an E4M3 cache, stay on Triton:
    FUSIONS_16)."""
    if x.shape[0] != 1 or norm_weight is None or (head_dim // 2) % 8 or slot_mapping.dtype != torch.int64:
        return False
    if weight.dtype == FP8:
        if kv_cache.dtype not in (x.dtype, FP8) or not w8a8:
            return False
    elif weight.dtype != x.dtype or kv_cache.dtype != x.dtype:
        return False
    return supported(x, weight, weight_scale=weight_scale, bias=bias, norm_weight=norm_weight,
                     input_scale=input_scale)


def dense_qkv_rope(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, *,
                   weight_scale: torch.Tensor | None, norm_weight: torch.Tensor, eps: float, rope_row: torch.Tensor,
                   slot_mapping: torch.Tensor, kv_cache: torch.Tensor, num_q_heads: int, num_kv_heads: int,
                   head_dim: int, kv_scale: torch.Tensor, input_scale: torch.Tensor | None = None,
                   config: DenseGemvConfig | None = None, pdl: bool | None = None) -> torch.Tensor:
    """gemv.qkv_rope_gemv's contract on this kernel (the caller checked `qkv_rope_supported`; kv_scale:
    float32 (k_scale, v_scale), ones for a 16-bit cache). A tile is 8 rotary pairs of one head, both
    halves (the .cu's tile_row). Returns q [1, Hq, D]."""
    k = x.shape[1]
    fp8 = weight.dtype == FP8
    rows = weight.shape[0]
    half = head_dim // 2
    fuse = ROPE | NORM | (KV_FP8 if kv_cache.dtype == FP8 else 0)
    kbytes = k * weight.element_size()
    row_tiles = rows // 16  # 8 pairs each
    cfg = config or choose_config(row_tiles, kbytes, fp8)
    q = torch.empty(1, num_q_heads, head_dim, dtype=x.dtype, device=x.device)
    args = (q.data_ptr(), x.data_ptr(), weight.data_ptr(), weight_scale.data_ptr() if weight_scale is not None else 0,
            bias.data_ptr() if bias is not None else 0, 1, rows, k, row_tiles, x.stride(0),
            weight.stride(0) * weight.element_size(),
            0, norm_weight.data_ptr(), eps, input_scale.data_ptr() if input_scale is not None else 0, 0, 0,
            rope_row.data_ptr(), slot_mapping.data_ptr(), kv_cache.data_ptr(), kv_scale.data_ptr(), half,
            num_q_heads, num_kv_heads, kv_cache.shape[2], kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2),
            kv_cache.stride(3), 0, 0)
    _launch(x, fp8, False, cfg, fuse, row_tiles, _shared_bytes(cfg, kbytes, False), args, pdl)
    return q
