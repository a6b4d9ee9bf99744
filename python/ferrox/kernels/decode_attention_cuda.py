"""Decode attention (one query token per request) on tensor cores: cuda/decode_attention.cu, compiled by
NVRTC (nvrtc.py).

`paged_attention.unified_attention` hands it every decode-only call `supported` accepts: 16-bit q and a
cache of q's dtype (head dims 64 and 128; it ignores kv_scale) or an FP8 E4M3 one with its (k_scale,
v_scale) (head dim 128; the products run in fp16), GQA groups of up to 16 query heads, power-of-two block
sizes of at least 16 (a warp's 16-position tile then lies in one block), on Hopper. Everything else --
prefill chunks, mixed batches, the CPU, the Triton interpreter -- keeps the Triton kernel, which stays the
reference the tests compare against.

The split plan is the Triton kernel's, with the merge inside the kernel: a launch has `num_splits` blocks a
(token, KV head), fixed per launch shape (a CUDA graph fixes it for max_model_len), and on the device each
request runs one of them if its context is at most `single_max` positions, else ceil(seq_len / split_len),
split_len = its share of the context rounded to whole 16-position tiles and at least `min_split` (the
blocks past those return at once). With one live split the block writes the output; with more,
each writes a partial and the last to finish merges them (an atomic counter a (token, KV head), which that
block resets to zero: the counters live in one buffer a device, zero between launches).

Batches whose (token, KV head) pairs fill the SMs run BATCH_CONFIG, 4 warps a block and two blocks an SM
(at head dim 128; other head dims keep the Triton kernel there): CONFIG's one block an SM starves many short
contexts of warps (1000 x (256, 256) throughput 1.5% below the Triton kernel's through it), the 4-warp
blocks beat the Triton kernel there (benches/RESULTS.md, thirty-seventh and thirty-eighth sessions).

FERROX_CUDA_DECODE_ATTN=0 turns it off (A/B runs).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from functools import cache

import torch

from ferrox.kernels import nvrtc
from ferrox.kernels.kv_fp8 import FP8_KV_DTYPE, unit_kv_scales
from ferrox.kernels.nvrtc import F32, I32, I64, PTR
from ferrox.kernels.pdl import pdl_enabled
from ferrox.kernels.split_k import num_sms

SOURCE_NAME = "decode_attention.cu"
_ENV = "FERROX_CUDA_DECODE_ATTN"
_ACT = {torch.bfloat16: "Bf16", torch.float16: "F16"}
HEAD_DIMS = (64, 128)
FP8_HEAD_DIMS = (128,)  # the FP8 fragment maps (the .cu's header) are for 128
MAX_GROUP = 16  # query heads a KV head: the MMA's rows
TILE = 16  # KV positions a warp takes per step
MAX_SPLITS = 256
_COUNTERS = 1 << 16  # (token, KV head) pairs a launch may have: the counter buffer a device
_LOG2E = 1.4426950408889634


@dataclass(frozen=True, slots=True)
class DecodeAttentionConfig:
    warps: int  # a block's warps; each streams its own tiles
    stages: int  # each warp's ring of 16-position K/V tiles (stages - 1 in flight)
    min_split: int  # KV positions a split takes at least (a multiple of TILE)
    single_max: int  # contexts up to this long run in one split (no merge)
    waves: float  # split so that (tokens x KV heads x splits) blocks fill this many waves of the GPU
    signal: int  # where the kernel lets its dependents launch: 0 never, 1 at its start, 2 after its KV loop

    def ring_bytes(self, head_dim: int, elem_bytes: int = 2) -> int:
        return self.warps * self.stages * 2 * TILE * head_dim * elem_bytes


# Chosen on an H200 (benches/RESULTS.md, thirty-seventh session; Llama-3.1-8B heads, batch 1, 32 layers in a
# CUDA graph bound at 131072): 8 warps x 3 stages (192 KB of rings: one block an SM, 16 splits at batch 1)
# streamed fastest from 1k to 122k. A merge costs ~1.5-2.5 us whatever the split count, so a context of up to
# 512 positions runs in one block (160 tokens: 5.6 us a layer against 7.2 in two splits, 300: 6.8 against
# 7.7 in three) and a longer one in splits of >= 128 (1k: 8.1 us against 9.6 in 256-position splits).
CONFIG = DecodeAttentionConfig(warps=8, stages=3, min_split=128, single_max=512, waves=1.0, signal=2)
# Batches of (token, KV head) pairs that fill the SMs (one split each): 4 warps x 3 stages, two blocks an SM,
# 3-7% faster than the Triton kernel from 500-token contexts at batches of 64-256 (thirty-seventh session).
BATCH_CONFIG = DecodeAttentionConfig(warps=4, stages=3, min_split=128, single_max=512, waves=1.0, signal=2)
BATCH_HEAD_DIMS = (128,)  # where BATCH_CONFIG runs; other head dims keep the Triton kernel for such batches
# (warps, stages) the module builds.
_COMPILED = ((CONFIG.warps, CONFIG.stages), (BATCH_CONFIG.warps, BATCH_CONFIG.stages))


def kernel_name(act: str, kv8: bool, head_dim: int, warps: int, stages: int) -> str:
    return f"ferrox_decode_attn_{act.lower()}{'_kv8' if kv8 else ''}_d{head_dim}_w{warps}_s{stages}"


def module_source(act: str, base: str) -> str:
    lines = [base]
    for kv8, head_dims in ((False, HEAD_DIMS), (True, FP8_HEAD_DIMS)):
        for head_dim in head_dims:
            for warps, stages in _COMPILED:
                lines.append(f"FERROX_DECODE_ATTENTION({kernel_name(act, kv8, head_dim, warps, stages)}, {act}, "
                             f"{'true' if kv8 else 'false'}, {head_dim}, {warps}, {stages})")
    return "\n".join(lines) + "\n"


def _base_source() -> str | None:
    return nvrtc.packaged_source(SOURCE_NAME)


@cache
def _module(act: str) -> nvrtc.CudaModule:
    base = _base_source()
    assert base is not None
    return nvrtc.CudaModule(f"decode_attention_{act.lower()}", module_source(act, base))


@cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


@cache
def _shared_optin(index: int) -> int:
    return int(torch.cuda.get_device_properties(index).shared_memory_per_block_optin) - 1024  # (static: is_last)


def enabled() -> bool:
    """The switch and the prerequisites (read on every call: tests and A/B runs flip the switch)."""
    return (os.environ.get(_ENV, "1") != "0" and os.environ.get("TRITON_INTERPRET") != "1"
            and nvrtc.bindings() is not None and _base_source() is not None)


def _aligned16(t: torch.Tensor) -> bool:
    return t.data_ptr() % 16 == 0 and all(s * t.element_size() % 16 == 0 for s in t.stride()[:-1])


_counters: dict[int, torch.Tensor] = {}


def supported(q: torch.Tensor, kv_cache: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor,
              kv_scale: torch.Tensor | None) -> bool:
    """Whether `decode_attention` takes this decode-only call (the shapes were checked by
    paged_attention.check_attention_inputs)."""
    # kv_scale: an FP8 cache's scales; a 16-bit cache ignores them, as the Triton kernel does.
    kv8 = kv_cache.dtype == FP8_KV_DTYPE
    if not q.is_cuda or q.dtype not in _ACT or (kv_cache.dtype != q.dtype and not kv8):
        return False
    if not enabled():
        return False
    index = q.device.index if q.device.index is not None else torch.cuda.current_device()
    if _capability(index) < (9, 0):
        return False
    _, _, block_size, kv_heads, head_dim = kv_cache.shape
    group = q.shape[1] // kv_heads
    if head_dim not in (FP8_HEAD_DIMS if kv8 else HEAD_DIMS) or group > MAX_GROUP:
        return False
    if block_size < TILE or block_size & (block_size - 1):
        return False
    if (q.shape[0] * kv_heads > _COUNTERS or block_table.dtype != torch.int32 or block_table.stride(-1) != 1
            or seq_lens.dtype != torch.int32):
        return False
    if q.stride(1) % 2 or q.stride(0) % 2 or not _aligned16(kv_cache):
        return False
    if shared_bytes(CONFIG, head_dim, kv_cache.element_size()) > _shared_optin(index):  # 192 KB: Hopper has 227
        return False
    if q.shape[0] * kv_heads >= num_sms(q.device) and head_dim not in BATCH_HEAD_DIMS:
        return False  # BATCH_CONFIG has been measured and run on the GPU at head dim 128 only
    # The counters are allocated before any capture (the graphs' warm-up forward runs first).
    return index in _counters or not torch.cuda.is_current_stream_capturing()


def config_for(pairs: int, device: torch.device) -> DecodeAttentionConfig:
    """CONFIG while the launch's (token, KV head) pairs leave SMs to split over, BATCH_CONFIG once they fill
    them (the module docstring)."""
    return CONFIG if pairs < num_sms(device) else BATCH_CONFIG


def live_splits(seq_len: int, num_splits: int, min_split: int, single_max: int) -> int:
    """The kernel's split plan on the host (tests): the splits a context of seq_len positions runs in."""
    if seq_len <= 0:
        return 0
    if seq_len <= single_max:
        return 1
    share = math.ceil(seq_len / num_splits)
    split_len = max(math.ceil(share / TILE) * TILE, min_split)
    return -(-seq_len // split_len)


def choose_num_splits(pairs: int, max_seq_len: int, config: DecodeAttentionConfig, blocks_per_sm: int,
                      num_sms: int) -> int:
    """Splits a (token, KV head) so the launch fills `config.waves` waves of blocks, from host numbers only
    (graph-safe); never shorter than min_split positions for max_seq_len."""
    room = blocks_per_sm * num_sms * config.waves
    if pairs >= room or max_seq_len <= config.single_max:
        return 1
    wanted = int(room // pairs)  # not more: a few blocks past one wave would double the launch's time
    return max(1, min(wanted, -(-max_seq_len // config.min_split), MAX_SPLITS))


_TYPES = (PTR,) * 9 + (F32,) + (I32,) * 5 + (I64,) * 9
_occupancy: dict[tuple[int, int, int], int] = {}


def _blocks_per_sm(fn: object, threads: int, shared: int) -> int:
    key = (int(fn), threads, shared)  # type: ignore[call-overload]
    if key not in _occupancy:
        _occupancy[key] = max(1, nvrtc.blocks_per_sm(fn, threads, shared))
    return _occupancy[key]


def shared_bytes(config: DecodeAttentionConfig, head_dim: int, elem_bytes: int = 2) -> int:
    """The rings or the warps' combine ([warps][16] max and sum, [warps][16][head_dim] outputs), whichever
    is larger: the combine reuses the rings."""
    return max(config.ring_bytes(head_dim, elem_bytes), config.warps * 16 * (2 + head_dim) * 4)


def decode_attention(q: torch.Tensor, kv_cache: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor, *,
                     max_seq_len: int, scale: float, out: torch.Tensor, num_splits: int | None = None,
                     config: DecodeAttentionConfig | None = None,
                     kv_scale: torch.Tensor | None = None) -> torch.Tensor:
    """out[t] = attention of q[t] [heads, head_dim] over request t's first seq_lens[t] cached positions
    (token t is request t; a request of length 0 leaves its row unspecified). max_seq_len: a host upper
    bound (the split count's). kv_scale: float32 (k_scale, v_scale) of an FP8 cache (None: 1.0). The caller
    checked `supported`."""
    tokens, heads, head_dim = q.shape
    _, _, block_size, kv_heads, _ = kv_cache.shape
    group = heads // kv_heads
    act = _ACT[q.dtype]
    index = q.device.index if q.device.index is not None else torch.cuda.current_device()
    cfg = config or config_for(tokens * kv_heads, q.device)
    kv8 = kv_cache.dtype == FP8_KV_DTYPE
    fn = _module(act).function(q.device, kernel_name(act, kv8, head_dim, cfg.warps, cfg.stages))
    shared = shared_bytes(cfg, head_dim, kv_cache.element_size())
    scales = (kv_scale if kv_scale is not None else unit_kv_scales(q.device)) if kv8 else None
    nvrtc.allow_shared(fn, shared)
    if num_splits is None:
        num_splits = choose_num_splits(tokens * kv_heads, max_seq_len, cfg,
                                       _blocks_per_sm(fn, 32 * cfg.warps, shared), num_sms(q.device))
    if not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits must be in 1..{MAX_SPLITS}, got {num_splits}")
    counters = _counters.get(index)
    if counters is None:
        counters = _counters[index] = torch.zeros(_COUNTERS, dtype=torch.int32, device=q.device)
    if num_splits > 1:
        partial_out = torch.empty(tokens, heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
        partial_ml = torch.empty(tokens, heads, num_splits, 2, dtype=torch.float32, device=q.device)
    else:
        partial_out = partial_ml = out  # not written with one split
    args = (out.data_ptr(), partial_out.data_ptr(), partial_ml.data_ptr(), counters.data_ptr(), q.data_ptr(),
            kv_cache.data_ptr(), scales.data_ptr() if scales is not None else 0, block_table.data_ptr(), seq_lens.data_ptr(), scale * _LOG2E, group,
            block_size.bit_length() - 1, cfg.min_split, cfg.single_max, cfg.signal, q.stride(0), q.stride(1), out.stride(0),
            out.stride(1), kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
            block_table.stride(0))
    nvrtc.launch(fn, (num_splits, kv_heads, tokens), 32 * cfg.warps, args, _TYPES,
                 torch.cuda.current_stream(q.device).cuda_stream, pdl=pdl_enabled(q.device), shared=shared)
    return out
