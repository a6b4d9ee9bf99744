"""Prefill attention over the paged KV cache, shaped for Hopper's tensor cores (FlashAttention-style).

Same contract and grid as `paged_attention.unified_attention` (GQA query tiles of BLOCK_Q tokens x
NUM_Q_PER_KV heads, numbered without a host sync, any block size), tuned for long prompt chunks
where attention is compute-bound rather than bandwidth-bound:

* Large tiles: 256 query rows x 64 KV positions over two warpgroups (128 x 64 over one with TMA).
  On sm90 Triton lowers tl.dot at these sizes to wgmma, and pipelines the K/V loads of the next
  tiles (cp.async or TMA, num_stages deep) under the current tile's matmuls and softmax. Tall
  query tiles matter most with pointer loads: each K/V tile's address arithmetic and loads are
  shared by more rows.
* Two loop phases. KV positions every row of the tile may see (before the tile's first query)
  run without any mask: no bounds checks on the loads, no causal select on the scores. Only the
  tiles that straddle the diagonal (and the ragged end) pay for masks. In a chunked prefill of a
  long prompt almost every tile is in the first phase.
* Heaviest tiles first: programs run the query tiles in reverse order, so the tiles with the most
  KV (the end of the last chunk) start in the first wave and the short ones fill the tail.
* The scale is applied after the row max (max(s) * scale = max(s * scale) for scale > 0), so the
  softmax costs one FMA and one exp2 per score.
* TMA (USE_TMA): when a KV block holds whole tiles (block_size % TILE_N == 0, e.g. block_size
  128), each K/V tile is one contiguous box of the cache and is fetched by the Tensor Memory
  Accelerator through a host-built descriptor (the cache viewed as [slots, kv_heads * head_dim]),
  instead of TILE_N x head_dim pointer loads. With the default block_size 16 a tile spans 8 blocks
  and Hopper's TMA has no gather, so the pointer path (cp.async) is used; FlashAttention 3 makes
  the same choice for small pages. Warp specialisation (tl.range(..., warp_specialize=True)) is
  not used: Triton's Hopper pass has been reported to fail on pointer-based loads feeding tl.dot
  (triton-lang/triton#9728), the default block size's path; it was not tried with TMA here.

FP8 cache (float8_e4m3fn, attention/kv_cache.py): K/V tiles arrive as bytes (pointer or TMA loads:
a descriptor over the float8 cache is a byte box, head_dim bytes wide, well above TMA's 16-byte
minimum) and are widened to q's dtype for the dots; k_scale joins the softmax scale and v_scale
the result, once per program. The dots stay in q's dtype rather than FP8 wgmma: that would also
quantize q and the probabilities, which vLLM's fp8 KV cache does not do either.

Compiled variants (everything else that varies per step is a runtime argument, and num_reqs /
v_row_offset / stride_bt are `do_not_specialize`, so a new batch shape never compiles): one per
(NUM_Q_PER_KV, HEAD_DIM, dtype) of the model x (launch config, USE_TMA) of `default_config`, which
depends only on the device, head_dim and block_size. An engine therefore reaches exactly one
variant of this kernel.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ferrox.kernels.kv_fp8 import unit_kv_scales
from ferrox.kernels.paged_attention import (
    _LOG2E,
    _dot_precision,
    _find_request,
    _softcap,
    check_attention_inputs,
    check_sinks,
    sink_init,
    softcap_log2,
)

try:  # host-side TMA descriptors (Triton >= 3.4)
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover (older Triton: pointer loads only)
    TensorDescriptor = None


@dataclass(frozen=True, slots=True)
class PrefillLaunchConfig:
    block_m: int  # query rows of a tile (tokens x GQA group), a power of two >= 16
    tile_n: int  # KV positions per inner step
    num_warps: int
    num_stages: int


# Chosen on an H200 with benches/bench_kernels.py --sweep (Llama-3.1-8B heads, bf16, an 8192-token
# chunk after 24576 / 114688 cached tokens): pointer loads (block_size 16) peak at 256 x 64 tiles over
# two warpgroups, 3 stages (434 / 426 TFLOP/s; the unified kernel's 64 x 64 tiles: 294 / 277);
# TMA loads (block_size 128) at 128 x 64 tiles, one warpgroup, 4 stages (509 / 490 TFLOP/s).
HOPPER_CONFIG = PrefillLaunchConfig(block_m=256, tile_n=64, num_warps=8, num_stages=3)
HOPPER_TMA_CONFIG = PrefillLaunchConfig(block_m=128, tile_n=64, num_warps=4, num_stages=4)
# Ampere and older (less shared memory, mma.sync), and head dims above 128 (whose Q, K and V tiles
# would not fit the Hopper tiles' shared memory): the unified kernel's prefill shape, or narrower.
FALLBACK_CONFIG = PrefillLaunchConfig(block_m=64, tile_n=64, num_warps=4, num_stages=2)
WIDE_HEAD_CONFIG = PrefillLaunchConfig(block_m=64, tile_n=32, num_warps=4, num_stages=2)


def default_config(kv_cache: torch.Tensor) -> PrefillLaunchConfig:
    """The launch config for this cache's device, head_dim and block size (one per engine)."""
    head_dim = kv_cache.shape[4]
    if head_dim > 128:
        return WIDE_HEAD_CONFIG
    if kv_cache.device.type == "cuda" and torch.cuda.get_device_capability(kv_cache.device)[0] >= 9:
        return HOPPER_TMA_CONFIG if tma_usable(kv_cache, HOPPER_TMA_CONFIG) else HOPPER_CONFIG
    return FALLBACK_CONFIG


@triton.jit
def _load_kv_tile(
    kv_desc, k_base, v_base, block_row, start, kv_hi, block_size, v_row_offset, kv_col,
    stride_cblock, stride_cslot,
    MASKED: tl.constexpr, USE_TMA: tl.constexpr, TILE_N: tl.constexpr, HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
):
    """K and V [TILE_N, DIM_PAD] at KV positions start .. start + TILE_N of one request and KV head.
    MASKED: positions may pass kv_hi (read as zeros). USE_TMA: the tile lies in one block."""
    if USE_TMA:
        block = tl.load(block_row + start // block_size)
        row = block * block_size + start % block_size
        k = kv_desc.load([row, kv_col])
        v = kv_desc.load([row + v_row_offset, kv_col])
    else:
        pos = start + tl.arange(0, TILE_N)
        dims = tl.arange(0, DIM_PAD)
        if MASKED:
            pos_valid = pos < kv_hi
            block = tl.load(block_row + pos // block_size, mask=pos_valid, other=0)
        else:
            block = tl.load(block_row + pos // block_size)
        offset = block.to(tl.int64) * stride_cblock + (pos % block_size) * stride_cslot
        ptrs = offset[:, None] + dims[None, :]
        if MASKED or HEAD_DIM != DIM_PAD:
            mask = dims[None, :] < HEAD_DIM
            if MASKED:
                mask = mask & pos_valid[:, None]
            k = tl.load(k_base + ptrs, mask=mask, other=0.0)
            v = tl.load(v_base + ptrs, mask=mask, other=0.0)
        else:
            k = tl.load(k_base + ptrs)
            v = tl.load(v_base + ptrs)
    return k, v


# The backend hands this kernel block_table[d:] and seq_lens[d:] after d leading decodes of a mixed
# step, so their 16-byte alignment changes with d: not specialised on, or each d class would compile
# a variant after the server says ready (worker/warmup.py).
@triton.jit(do_not_specialize=["num_reqs", "v_row_offset", "stride_bt"],
            do_not_specialize_on_alignment=["block_table_ptr", "seq_lens_ptr"])
def _prefill_attention_kernel(
    out_ptr,
    q_ptr,
    cache_ptr,
    kv_scale_ptr,
    kv_desc,
    block_table_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    scale_log2,
    num_reqs,
    block_size,
    v_row_offset,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_ckv,
    stride_cblock,
    stride_cslot,
    stride_chead,
    stride_bt,
    NUM_Q_PER_KV: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    TILE_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
    USE_TMA: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    SOFTCAP: tl.constexpr = 0.0,  # Gemma 2's attention logit cap (paged_attention.softcap_log2; 0: none)
    WINDOW: tl.constexpr = 0,  # sliding window: a query at p sees keys p - WINDOW < k <= p (0: all)
    sinks_ptr=None,  # HAS_SINKS: float32 [num_heads], gpt-oss's attention sinks (paged_attention.sink_init)
    HAS_SINKS: tl.constexpr = False,
    CHUNK: tl.constexpr = 0,  # chunked local attention: a query at p sees keys (p // CHUNK) * CHUNK <= k <= p (0: all)
):
    tile_id = tl.num_programs(0) - 1 - tl.program_id(0)  # heaviest (latest) query tiles first
    kv_head = tl.program_id(1)

    req = _find_request(query_start_loc_ptr, num_reqs, tile_id, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + req)
    query_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    q_tile = tile_id - (q_start // BLOCK_Q + req)
    if q_tile * BLOCK_Q >= query_len:
        return
    seq_len = tl.load(seq_lens_ptr + req)
    context_len = seq_len - query_len

    # Row m of the tile is query token m // NUM_Q_PER_KV of the tile, head m % NUM_Q_PER_KV of the group.
    rows = tl.arange(0, BLOCK_M)
    q_local = q_tile * BLOCK_Q + rows // NUM_Q_PER_KV
    head = kv_head * NUM_Q_PER_KV + rows % NUM_Q_PER_KV
    row_valid = (rows < BLOCK_Q * NUM_Q_PER_KV) & (q_local < query_len)
    token = (q_start + q_local).to(tl.int64)
    q_pos = context_len + q_local
    dims = tl.arange(0, DIM_PAD)
    dim_valid = dims < HEAD_DIM
    q = tl.load(
        q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :],
        mask=row_valid[:, None] & dim_valid[None, :],
        other=0.0,
    )
    FP8_KV: tl.constexpr = cache_ptr.dtype.element_ty == tl.float8e4nv
    if FP8_KV:
        scale_log2 = scale_log2 * tl.load(kv_scale_ptr)  # k_scale > 0: the max trick below still holds

    first_q_pos = context_len + q_tile * BLOCK_Q
    kv_end = tl.minimum(seq_len, context_len + tl.minimum((q_tile + 1) * BLOCK_Q, query_len))
    # Every row sees positions <= first_q_pos: whole tiles below that need no mask at all.
    full_end = (first_q_pos + 1) // TILE_N * TILE_N
    kv_start = full_end * 0
    if WINDOW > 0:
        # Rows of a tile see different windows: every tile is masked, from the first row's window on
        # (TILE_N-aligned, so a TMA tile still lies in one block).
        kv_start = tl.maximum(first_q_pos - WINDOW + 1, 0) // TILE_N * TILE_N
        full_end = kv_start
    if CHUNK > 0:
        # Nothing before the first row's chunk is visible. A tile whose rows share one chunk that starts on a
        # TILE_N boundary keeps the unmasked phase up to its first query; other tiles are masked throughout.
        chunk_lo = first_q_pos // CHUNK * CHUNK
        kv_start = tl.maximum(kv_start, chunk_lo // TILE_N * TILE_N)
        last_q_pos = context_len + tl.minimum((q_tile + 1) * BLOCK_Q, query_len) - 1
        one_chunk = (last_q_pos // CHUNK == first_q_pos // CHUNK) & (chunk_lo % TILE_N == 0)
        if WINDOW > 0:
            full_end = kv_start
        else:
            full_end = tl.where(one_chunk, tl.maximum(full_end, kv_start), kv_start)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    if HAS_SINKS:  # (the sink's max is finite: the unmasked phase's max trick still holds)
        m_i, l_i = sink_init(sinks_ptr, head, m_i, l_i, True)
    acc = tl.zeros([BLOCK_M, DIM_PAD], tl.float32)
    k_base = cache_ptr + kv_head * stride_chead
    v_base = k_base + stride_ckv
    kv_col = kv_head * HEAD_DIM
    block_row = block_table_ptr + req.to(tl.int64) * stride_bt

    for start in range(kv_start, full_end, TILE_N):
        k, v = _load_kv_tile(kv_desc, k_base, v_base, block_row, start, full_end, block_size, v_row_offset, kv_col,
                             stride_cblock, stride_cslot, False, USE_TMA, TILE_N, HEAD_DIM, DIM_PAD)
        k, v = k.to(q.dtype), v.to(q.dtype)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        if SOFTCAP > 0:  # (the cap is monotonic: the row max of capped scores is the capped max)
            s = _softcap(s * scale_log2, SOFTCAP)
            m_new = tl.maximum(m_i, tl.max(s, 1))
            p = tl.exp2(s - m_new[:, None])
        else:
            m_new = tl.maximum(m_i, tl.max(s, 1) * scale_log2)
            p = tl.exp2(s * scale_log2 - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
        m_i = m_new

    cols = tl.arange(0, TILE_N)
    for start in range(full_end, kv_end, TILE_N):
        k, v = _load_kv_tile(kv_desc, k_base, v_base, block_row, start, kv_end, block_size, v_row_offset, kv_col,
                             stride_cblock, stride_cslot, True, USE_TMA, TILE_N, HEAD_DIM, DIM_PAD)
        k, v = k.to(q.dtype), v.to(q.dtype)
        pos = start + cols
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
        if SOFTCAP > 0:
            s = _softcap(s, SOFTCAP)
        visible = (pos[None, :] < kv_end) & (pos[None, :] <= q_pos[:, None])
        if WINDOW > 0:
            visible = visible & (pos[None, :] > q_pos[:, None] - WINDOW)
        if CHUNK > 0:
            visible = visible & (pos[None, :] >= q_pos[:, None] // CHUNK * CHUNK)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row with nothing visible yet keeps max -inf; subtract 0 instead so exp2 gives 0, not NaN.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
        m_i = m_new

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    result = acc / l_safe[:, None]
    if FP8_KV:
        result = result * tl.load(kv_scale_ptr + 1)
    tl.store(
        out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :],
        result.to(out_ptr.dtype.element_ty),
        mask=row_valid[:, None] & dim_valid[None, :],
    )


def tma_usable(kv_cache: torch.Tensor, config: PrefillLaunchConfig) -> bool:
    """Whether K/V tiles can be fetched by TMA: whole tiles inside one block, a contiguous cache
    (viewed as [slots, kv_heads * head_dim]), a power-of-two head_dim, a Hopper-class GPU (or the
    interpreter, which emulates descriptors)."""
    if TensorDescriptor is None or not kv_cache.is_contiguous():
        return False
    block_size, head_dim = kv_cache.shape[2], kv_cache.shape[4]
    if block_size % config.tile_n != 0 or head_dim & (head_dim - 1) or head_dim < 16:
        return False
    if kv_cache.device.type == "cuda":
        return torch.cuda.get_device_capability(kv_cache.device)[0] >= 9
    return True


def prefill_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    *,
    scale: float,
    out: torch.Tensor | None = None,
    config: PrefillLaunchConfig | None = None,
    use_tma: bool | None = None,
    kv_scale: torch.Tensor | None = None,
    softcap: float = 0.0,
    window: int = 0,
    sinks: torch.Tensor | None = None,
    chunk: int = 0,
) -> torch.Tensor:
    """Causal paged attention of q [num_tokens, num_heads, head_dim] over kv_cache (K/V already
    written), for batches led by prefill chunks. Arguments as `unified_attention` (no split-KV:
    prefill tiles already fill the GPU). use_tma: None picks TMA when `tma_usable`."""
    check_attention_inputs(q, kv_cache, kv_scale)
    check_sinks(sinks, q.shape[1])
    if not scale > 0.0:
        raise ValueError(f"scale must be > 0, got {scale}")
    if out is None:
        out = torch.empty_like(q)
    num_tokens, num_heads, head_dim = q.shape
    num_reqs = seq_lens.shape[0]
    if num_tokens == 0 or num_reqs == 0:
        return out
    _, num_blocks, block_size, num_kv_heads, _ = kv_cache.shape
    if config is None:
        config = default_config(kv_cache)
    group = num_heads // num_kv_heads
    block_m = max(config.block_m, triton.next_power_of_2(group))
    block_q = block_m // group
    dim_pad = triton.next_power_of_2(head_dim)
    if use_tma is None:
        use_tma = tma_usable(kv_cache, config)
    elif use_tma and not tma_usable(kv_cache, config):
        raise ValueError(f"use_tma: TMA needs block_size ({block_size}) to be a multiple of tile_n ({config.tile_n}), "
                         "a contiguous cache, a power-of-two head_dim and an sm90+ GPU")
    kv_desc = None
    if use_tma:
        slots = kv_cache.view(2 * num_blocks * block_size, num_kv_heads * head_dim)
        kv_desc = TensorDescriptor.from_tensor(slots, [config.tile_n, head_dim])

    num_tiles = num_tokens // block_q + num_reqs
    _prefill_attention_kernel[(num_tiles, num_kv_heads)](
        out,
        q,
        kv_cache,
        kv_scale if kv_scale is not None else unit_kv_scales(q.device),
        kv_desc,
        block_table,
        seq_lens,
        query_start_loc,
        scale * _LOG2E,
        num_reqs,
        block_size,
        num_blocks * block_size,  # V rows start after all K rows in the descriptor's view
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        kv_cache.stride(3),
        block_table.stride(0),
        NUM_Q_PER_KV=group,
        BLOCK_Q=block_q,
        BLOCK_M=block_m,
        TILE_N=config.tile_n,
        HEAD_DIM=head_dim,
        DIM_PAD=dim_pad,
        USE_TMA=use_tma,
        DOT_PRECISION=_dot_precision(q.dtype),
        SOFTCAP=softcap_log2(softcap),
        WINDOW=window,
        sinks_ptr=sinks,
        HAS_SINKS=sinks is not None,
        CHUNK=chunk,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    return out
