"""Unified paged attention for mixed batches (prefill chunks + decodes) over the paged KV cache.

One Triton program handles one (query tile, KV head[, KV split]). A query tile is BLOCK_Q
consecutive query tokens of one request times the NUM_Q_PER_KV query heads that share the KV head
(GQA), so each K/V tile is loaded once for the whole head group and feeds a tensor-core dot.
The program walks the request's KV positions in TILE_N steps, translating each position to a
slot through the block table (so any block size works), with an online softmax in fp32 and a
causal mask inside the chunk: query i of a request with `query_len` new tokens sits at absolute
position `seq_len - query_len + i`.

Decode-only calls on Hopper (a 16-bit cache, or an FP8 one at head dim 128) go to
cuda/decode_attention.cu instead (kernels/decode_attention_cuda.py: per-warp cp.async rings and the
split merge inside the kernel; benches/RESULTS.md, thirty-seventh session: 160 tokens of context 8.7 ->
5.6 us a layer, 122k 127.8 -> 122.8; thirty-eighth: an FP8 cache at 122k 169 -> 74); this kernel remains
for everything else and is the reference its tests compare against.

Query tiles are numbered without a host sync: request r's tiles start at
`query_start_loc[r] // BLOCK_Q + r`, a strictly increasing sequence, so the grid is the upper
bound `num_tokens // BLOCK_Q + num_reqs` and each program finds its request by binary search.
Programs past a request's last tile return at once. Nothing here reads device data on the host,
so the decode path can be captured in a CUDA graph (max_seq_len is then a fixed upper bound).

Split-KV (flash decoding): with few requests and long contexts the grid above leaves most SMs
idle, so the KV range of each request is cut into num_splits segments handled by separate
programs that write a partial output plus its softmax max and sum; a reduce kernel merges them.
The split count is a runtime argument (only "split or not" is compiled in), so the many split
counts a CUDA-graph ladder picks cost two compiled variants, not one per count. A graph fixes the
count for max_model_len, while the contexts it replays are mostly short; so in a decode-only
batch each request's splits are at least _MIN_SPLIT_LEN positions long, the programs past its
live splits return at once, a request with one live split is written by the attention kernel
itself, and the merge reads only live partials (and skips the one-split rows). At batch 1 the
heuristic aims at two waves of programs (8 KV heads x 33 splits on 132 SMs); on an H200 at a
122k context 32-48 splits stream KV fastest (fewer leave SMs idle, more shrink each program's
pipelined loop and add partials). The merge loops over the partials, so the count has no compiled
upper bound.

Compiled variants. Runtime integers that vary per step (num_reqs, num_splits, the block-table
row stride) are `do_not_specialize`; strides, head counts and block_size are fixed per engine.
Per model (NUM_Q_PER_KV, DIM_PAD, dtype) the dispatch reaches at most four variants of the
attention kernel -- (DECODE_CONFIG, SPLIT_KV=False) for decode-only steps, (DECODE_SPLIT_CONFIG,
SPLIT_KV=True) for split decodes, (PREFILL_CONFIG, SPLIT_KV=False / True) for batches whose
chunks are shorter than the backend's PREFILL_MIN_QUERY_LEN -- and one of the merge kernel
(SPLIT_CHUNK fixed). Longer chunks run kernels/prefill_attention.py (attention/triton_backend.py
decides). The profiling forward, which views its own k/v as a cache of one-slot blocks, adds
block_size == 1 variants once, before the engine is ready.

FP8 cache (float8_e4m3fn, attention/kv_cache.py): K/V tiles are loaded as bytes (half the traffic
of bf16) and widened to q's dtype for the dots; k_scale, read by pointer, multiplies the softmax
scale once per program and v_scale the program's result, so no tile is rescaled element by element.
The cache dtype is part of the kernel's signature: an FP8 engine compiles its own variants.

Attention sinks (gpt-oss; HAS_SINKS, a float32 logit per query head): each row's online softmax starts
from the sink, max = sink and sum = 1 (`sink_init`), as if it were one more key with value 0; under
split-KV only a request's first split starts so, and the merge weighs it in with that split's sum. The
CUDA decode kernel has no sinks: such calls stay here. kernels/prefill_attention.py does the same.

Chunked local attention (Llama 4; CHUNK, default off): a query at position p sees only the keys of its own
chunk, (p // CHUNK) * CHUNK <= k <= p. A tile starts its KV walk at its first query's chunk and masks each
row's own lower bound; the CUDA decode kernel has no chunks, so such calls stay here too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ferrox.kernels import decode_attention_cuda
from ferrox.kernels.kv_fp8 import FP8_KV_DTYPE, unit_kv_scales
from ferrox.kernels.pdl import pdl_launch, pdl_launch_dependents, pdl_wait
from ferrox.kernels.split_k import num_sms as _num_sms

_LOG2E = 1.4426950408889634


@triton.jit
def _softcap(s, SOFTCAP: tl.constexpr):
    """Gemma 2's score cap on log2-domain scores s = x * log2(e): cap * tanh(x / cap) * log2(e) equals
    SOFTCAP * tanh(s / SOFTCAP) with SOFTCAP = cap * log2(e) (`softcap_log2`); the identity
    tanh(y) = 1 - 2 / (exp(2y) + 1) saturates to +-1 without NaN at either end."""
    return SOFTCAP * (1.0 - 2.0 / (tl.exp(2.0 * s / SOFTCAP) + 1.0))


@triton.jit
def sink_init(sinks_ptr, head, m_i, l_i, take):
    """Online-softmax state that starts with the attention sink (gpt-oss): a key of logit sinks[head]
    and value 0, i.e. max = the sink (log2 domain, as the kernels' scores) and sum = exp2(0) = 1, so
    the sink joins every row's denominator and adds nothing to the output. take: whether this
    program carries it (one split of a request; the others keep the empty state)."""
    sink = tl.load(sinks_ptr + head).to(tl.float32) * 1.4426950408889634
    return tl.where(take, sink, m_i), tl.where(take, 1.0, l_i)


def check_sinks(sinks: torch.Tensor | None, num_heads: int) -> None:
    """Attention sinks are float32 [num_heads], one logit per query head."""
    if sinks is not None and (sinks.dtype != torch.float32 or tuple(sinks.shape) != (num_heads,)
                              or not sinks.is_contiguous()):
        raise ValueError(f"sinks must be a contiguous float32 [{num_heads}] tensor, got {sinks.dtype} "
                         f"{tuple(sinks.shape)}")


def softcap_log2(softcap: float) -> float:
    """The kernels' SOFTCAP constant for an attention logit cap (0: none)."""
    return softcap * _LOG2E if softcap else 0.0


@triton.jit
def _find_request(query_start_loc_ptr, num_reqs, tile_id, BLOCK_Q: tl.constexpr):
    """Largest r with query_start_loc[r] // BLOCK_Q + r <= tile_id (binary search)."""
    lo = num_reqs * 0  # a tensor, not a constexpr: loop-carried values keep one type
    hi = num_reqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_tile = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first_tile <= tile_id:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _split_len(seq_len, num_splits, TILE_N: tl.constexpr, MIN_SPLIT: tl.constexpr, DECODE_ONLY: tl.constexpr):
    """KV positions per split of a request of seq_len tokens: whole TILE_N steps; in a decode-only
    batch at least MIN_SPLIT, so a short context runs in fewer live splits than launched (the
    count is fixed per CUDA graph, the contexts are not). The attention and merge kernels agree
    on it."""
    split_len = tl.cdiv(tl.cdiv(seq_len, num_splits), TILE_N) * TILE_N
    if DECODE_ONLY:
        split_len = tl.maximum(split_len, MIN_SPLIT)
    return split_len


# Runtime integers that change from step to step are not specialised on (Triton would otherwise
# compile a variant per "== 1" / "divisible by 16" class of each): see the module docstring.
@triton.jit(do_not_specialize=["num_reqs", "stride_bt", "num_splits"])
def _paged_attention_kernel(
    out_ptr,
    partial_out_ptr,
    partial_max_ptr,
    partial_sum_ptr,
    q_ptr,
    cache_ptr,
    kv_scale_ptr,
    block_table_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    scale_log2,
    num_reqs,
    num_q_heads,
    head_dim,
    block_size,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_ckv,
    stride_cblock,
    stride_cslot,
    stride_chead,
    stride_bt,
    num_splits,
    NUM_Q_PER_KV: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    TILE_N: tl.constexpr,
    DIM_PAD: tl.constexpr,
    SPLIT_KV: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    USE_PDL: tl.constexpr,  # launched with programmatic dependent launch (pdl.py)
    DECODE_ONLY: tl.constexpr = False,  # one query token per request (token i is request i)
    MIN_SPLIT: tl.constexpr = 256,
    SOFTCAP: tl.constexpr = 0.0,  # Gemma 2's attention logit cap, as softcap_log2 gives it (0: none)
    WINDOW: tl.constexpr = 0,  # sliding window: a query at p sees keys p - WINDOW < k <= p (0: all)
    sinks_ptr=None,  # HAS_SINKS: float32 [num_q_heads], gpt-oss's attention sinks (`sink_init`)
    HAS_SINKS: tl.constexpr = False,
    CHUNK: tl.constexpr = 0,  # chunked local attention: a query at p sees keys (p // CHUNK) * CHUNK <= k <= p (0: all)
):
    pdl_launch_dependents(USE_PDL)
    tile_id = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    pdl_wait(USE_PDL)  # (q and this step's K/V come from the kernels before)

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
    dim_valid = dims < head_dim

    q = tl.load(
        q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :],
        mask=row_valid[:, None] & dim_valid[None, :],
        other=0.0,
    )
    FP8_KV: tl.constexpr = cache_ptr.dtype.element_ty == tl.float8e4nv
    if FP8_KV:
        scale_log2 = scale_log2 * tl.load(kv_scale_ptr)

    # Causal: nothing past this tile's last query is visible.
    kv_end = tl.minimum(seq_len, context_len + tl.minimum((q_tile + 1) * BLOCK_Q, query_len))
    alone = seq_len < 0  # (a runtime False: this program's split is the request's only one)
    if SPLIT_KV:
        # Split boundaries depend on seq_len only (not on the tile), in whole TILE_N steps.
        split_len = _split_len(seq_len, num_splits, TILE_N, MIN_SPLIT, DECODE_ONLY)
        if DECODE_ONLY:
            live = tl.cdiv(seq_len, split_len)
            if split >= tl.maximum(live, 1):
                return  # past the context: nothing to write, the merge reads only live splits
            # One live split (or none: a CUDA graph's padding row, seq_len 0, gets zeros) writes the
            # output itself, and the merge leaves that row alone.
            alone = live <= 1
        kv_lo = split * split_len
        kv_hi = tl.minimum(kv_end, kv_lo + split_len)
    else:
        kv_lo = 0
        kv_hi = kv_end
    if WINDOW > 0:  # nothing before the first query's window is visible to any row of the tile
        kv_lo = tl.maximum(kv_lo, context_len + q_tile * BLOCK_Q - WINDOW + 1)
    if CHUNK > 0:  # nor anything before the first query's chunk (a split wholly before it stays empty)
        kv_lo = tl.maximum(kv_lo, (context_len + q_tile * BLOCK_Q) // CHUNK * CHUNK)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    if HAS_SINKS:  # a request's first split carries the sink term (the merge adds it to the others')
        m_i, l_i = sink_init(sinks_ptr, head, m_i, l_i, split == 0)
    acc = tl.zeros([BLOCK_M, DIM_PAD], tl.float32)
    k_base = cache_ptr + kv_head * stride_chead
    v_base = k_base + stride_ckv
    cols = tl.arange(0, TILE_N)
    block_row = block_table_ptr + req.to(tl.int64) * stride_bt

    for start in range(kv_lo, kv_hi, TILE_N):
        pos = start + cols
        pos_valid = pos < kv_hi
        block = tl.load(block_row + pos // block_size, mask=pos_valid, other=0)
        slot_offset = block.to(tl.int64) * stride_cblock + (pos % block_size) * stride_cslot
        kv_mask = pos_valid[:, None] & dim_valid[None, :]
        k = tl.load(k_base + slot_offset[:, None] + dims[None, :], mask=kv_mask, other=0.0).to(q.dtype)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
        if SOFTCAP > 0:
            s = _softcap(s, SOFTCAP)
        visible = pos_valid[None, :] & (pos[None, :] <= q_pos[:, None])
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
        v = tl.load(v_base + slot_offset[:, None] + dims[None, :], mask=kv_mask, other=0.0).to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    result = acc / l_safe[:, None]
    if FP8_KV:
        result = result * tl.load(kv_scale_ptr + 1)
    if SPLIT_KV and not alone:
        partial = (token * num_q_heads + head) * num_splits + split
        tl.store(partial_out_ptr + partial[:, None] * DIM_PAD + dims[None, :], result, mask=row_valid[:, None])
        tl.store(partial_max_ptr + partial, m_i, mask=row_valid)
        tl.store(partial_sum_ptr + partial, l_i, mask=row_valid)
    else:
        tl.store(
            out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :],
            result.to(out_ptr.dtype.element_ty),
            mask=row_valid[:, None] & dim_valid[None, :],
        )


@triton.jit(do_not_specialize=["num_splits"])
def _merge_splits_kernel(
    out_ptr,
    partial_out_ptr,
    partial_max_ptr,
    partial_sum_ptr,
    num_q_heads,
    head_dim,
    stride_ot,
    stride_oh,
    num_splits,
    seq_lens_ptr,
    num_reqs,
    SPLIT_CHUNK: tl.constexpr,
    DIM_PAD: tl.constexpr,
    USE_PDL: tl.constexpr,
    DECODE_ONLY: tl.constexpr = False,  # as the attention kernel's: then only live splits are read
    TILE_N: tl.constexpr = 128,
    MIN_SPLIT: tl.constexpr = 256,
):
    """out = sum_s w_s o_s / sum_s w_s with w_s = l_s * 2^(m_s - max m), over the partials. In a
    decode-only batch a request whose context fits one split was written by the attention kernel
    itself.

    Up to SPLIT_CHUNK live partials (a B=1 graph's 33) are read in one pass: their maxima, sums and
    outputs are requested together, so the merge waits one memory latency after its context length
    instead of one per pass and chunk (on an H200, 33 splits: attention + merge 18.3 -> 17.5 us a layer
    at 8k tokens of context, 27.8 -> 26.8 at 16k; benches/RESULTS.md). More partials loop, SPLIT_CHUNK
    at a time, in two passes (the max first, so every weight is exact)."""
    pdl_launch_dependents(USE_PDL)
    pdl_wait(USE_PDL)
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    base = (token * num_q_heads + head) * num_splits
    live = num_splits
    if DECODE_ONLY:
        if token >= num_reqs:
            return  # a padding row
        seq_len = tl.load(seq_lens_ptr + token)
        live = tl.cdiv(seq_len, _split_len(seq_len, num_splits, TILE_N, MIN_SPLIT, DECODE_ONLY))
        if live <= 1:
            return
    splits = tl.arange(0, SPLIT_CHUNK)
    dims = tl.arange(0, DIM_PAD)
    if live <= SPLIT_CHUNK:
        used = splits < live
        m = tl.load(partial_max_ptr + base + splits, mask=used, other=float("-inf"))
        l_sum = tl.load(partial_sum_ptr + base + splits, mask=used, other=0.0)
        o = tl.load(partial_out_ptr + (base + splits)[:, None] * DIM_PAD + dims[None, :], mask=used[:, None],
                    other=0.0)
        m_top = tl.max(m, 0)
        weight = l_sum * tl.exp2(m - tl.where(m_top == float("-inf"), 0.0, m_top))
        sum_w = tl.sum(weight, 0)
        result = tl.sum(o * weight[:, None], 0) / tl.where(sum_w == 0.0, 1.0, sum_w)
    else:
        m_max = tl.full([SPLIT_CHUNK], float("-inf"), tl.float32)
        for first in range(0, live, SPLIT_CHUNK):
            used = first + splits < live
            m_max = tl.maximum(m_max, tl.load(partial_max_ptr + base + first + splits, mask=used,
                                              other=float("-inf")))
        m_top = tl.max(m_max, 0)
        m_top = tl.where(m_top == float("-inf"), 0.0, m_top)
        total = tl.zeros([SPLIT_CHUNK], tl.float32)
        acc = tl.zeros([SPLIT_CHUNK, DIM_PAD], tl.float32)
        for first in range(0, live, SPLIT_CHUNK):
            idx = first + splits
            used = idx < live
            m = tl.load(partial_max_ptr + base + idx, mask=used, other=float("-inf"))
            l_sum = tl.load(partial_sum_ptr + base + idx, mask=used, other=0.0)
            weight = l_sum * tl.exp2(m - m_top)  # empty splits: l = 0 and m = -inf -> weight 0
            o = tl.load(partial_out_ptr + (base + idx)[:, None] * DIM_PAD + dims[None, :], mask=used[:, None],
                        other=0.0)
            total += weight
            acc += o * weight[:, None]
        sum_w = tl.sum(total, 0)
        result = tl.sum(acc, 0) / tl.where(sum_w == 0.0, 1.0, sum_w)
    tl.store(out_ptr + token * stride_ot + head * stride_oh + dims, result.to(out_ptr.dtype.element_ty), mask=dims < head_dim)


@dataclass(frozen=True, slots=True)
class AttentionLaunchConfig:
    block_m: int  # rows of a query tile (query tokens x GQA group), a power of two >= 16
    tile_n: int  # KV positions per inner step
    num_warps: int
    num_stages: int


# Chosen on an H200 with `benches/bench_kernels.py --sweep` (benches/RESULTS.md): 64-position KV
# tiles were best for full decode batches (98% of copy bandwidth at B=256), 128 with 3 stages for
# split-KV decodes (few requests, long contexts: 3.66 TB/s at B=1, 122k context, 32-48 splits;
# 64-position tiles peak at 3.63 TB/s with 66), 64x64 tiles for mixed batches (prefill-led
# batches go to kernels/prefill_attention.py).
DECODE_CONFIG = AttentionLaunchConfig(block_m=16, tile_n=64, num_warps=4, num_stages=2)
DECODE_SPLIT_CONFIG = AttentionLaunchConfig(block_m=16, tile_n=128, num_warps=4, num_stages=3)
PREFILL_CONFIG = AttentionLaunchConfig(block_m=64, tile_n=64, num_warps=4, num_stages=2)
# Split-KV only when the plain grid fills less than one wave of SMs and contexts are at least this
# long (shorter ones finish in a few KV tiles anyway).
_MIN_SEQ_FOR_SPLIT = 512
# Splitting aims at this many waves of programs (see the module docstring for the measurement).
_SPLIT_WAVES = 2
# ... but no split shorter than this many KV positions (each split costs a partial write + merge).
_MIN_SPLIT_LEN = 256
_MAX_SPLITS = 256
_MERGE_CHUNK = 64  # partials the merge reads in one pass (it loops over any num_splits)


def choose_num_splits(num_programs: int, max_seq_len: int, num_sms: int) -> int:
    """Split-KV heuristic on host-known numbers only (grid size, max_seq_len): graph-safe. The
    count is a runtime kernel argument, so any value costs no compilation."""
    if max_seq_len < _MIN_SEQ_FOR_SPLIT or num_programs >= num_sms:
        return 1
    wanted = math.ceil(_SPLIT_WAVES * num_sms / max(num_programs, 1))
    wanted = min(wanted, max_seq_len // _MIN_SPLIT_LEN, _MAX_SPLITS)
    return max(wanted, 1)


def check_attention_inputs(q: torch.Tensor, kv_cache: torch.Tensor, kv_scale: torch.Tensor | None = None) -> None:
    """The shape rules every paged-attention entry point shares; the error names the argument."""
    if kv_scale is not None and (kv_scale.dtype != torch.float32 or kv_scale.numel() != 2):
        raise ValueError(f"kv_scale must be float32 (k_scale, v_scale), got {kv_scale.dtype} {tuple(kv_scale.shape)}")
    if kv_cache.dtype != q.dtype and kv_cache.dtype != FP8_KV_DTYPE:
        raise ValueError(f"kv_cache dtype {kv_cache.dtype} must be q's ({q.dtype}) or {FP8_KV_DTYPE}")
    if q.dim() != 3:
        raise ValueError(f"q must be [num_tokens, num_heads, head_dim], got {tuple(q.shape)}")
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2:
        raise ValueError(f"kv_cache must be [2, num_blocks, block_size, num_kv_heads, head_dim], got {tuple(kv_cache.shape)}")
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads, cache_head_dim = kv_cache.shape[3], kv_cache.shape[4]
    if cache_head_dim != head_dim:
        raise ValueError(f"q head_dim {head_dim} != kv_cache head_dim {cache_head_dim}")
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if q.stride(-1) != 1 or kv_cache.stride(-1) != 1:
        raise ValueError("q and kv_cache need a contiguous head_dim axis")


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 tests must not silently drop to tf32 on the GPU.
    return "ieee" if dtype == torch.float32 else "tf32"


def unified_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    *,
    max_query_len: int,
    max_seq_len: int,
    scale: float,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
    config: AttentionLaunchConfig | None = None,
    kv_scale: torch.Tensor | None = None,
    softcap: float = 0.0,
    window: int = 0,
    sinks: torch.Tensor | None = None,
    chunk: int = 0,
) -> torch.Tensor:
    """Paged attention of q [num_tokens, num_heads, head_dim] over kv_cache (K/V already written).

    query_start_loc [num_reqs + 1], seq_lens [num_reqs], block_table [num_reqs, max_blocks] are the
    AttentionMetadata device tensors. max_query_len / max_seq_len are host upper bounds that pick
    the launch shape (no device sync). Output rows past query_start_loc[-1] (padding) are
    unspecified. kv_scale: float32 (k_scale, v_scale) of an FP8 cache (None: 1.0). softcap: Gemma 2's
    attention logit cap (0: none; the CUDA decode kernel has none, so this kernel takes those steps).
    window: a sliding window (a query at p sees keys p - window < k <= p; 0: all), likewise. sinks:
    float32 [num_heads] attention sinks (gpt-oss; None: none), likewise. chunk: Llama 4's chunked local
    attention (a query at p sees keys (p // chunk) * chunk <= k <= p; 0: all), likewise."""
    check_attention_inputs(q, kv_cache, kv_scale)
    check_sinks(sinks, q.shape[1])
    num_tokens, num_heads, head_dim = q.shape
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    if out is None:
        out = torch.empty_like(q)
    num_reqs = seq_lens.shape[0]
    if num_tokens == 0 or num_reqs == 0:
        return out
    if (config is None and num_splits is None and max_query_len <= 1 and num_tokens <= num_reqs and not softcap
            and not window and not chunk and sinks is None and decode_attention_cuda.supported(q, kv_cache, seq_lens, block_table, kv_scale)):
        # Decode-only on Hopper: the CUDA kernel (its module docstring); this kernel stays the reference.
        return decode_attention_cuda.decode_attention(q, kv_cache, seq_lens, block_table, max_seq_len=max_seq_len,
                                                      scale=scale, out=out, kv_scale=kv_scale)

    group = num_heads // num_kv_heads
    if config is None:
        config = DECODE_CONFIG if max_query_len <= 1 else PREFILL_CONFIG
    block_m = max(config.block_m, triton.next_power_of_2(group))
    block_q = block_m // group
    dim_pad = triton.next_power_of_2(head_dim)
    num_tiles = num_tokens // block_q + num_reqs
    if num_splits is None:
        num_splits = choose_num_splits(num_tiles * num_kv_heads, max_seq_len, _num_sms(q.device))
    if not 1 <= num_splits <= _MAX_SPLITS:
        raise ValueError(f"num_splits must be in 1..{_MAX_SPLITS}, got {num_splits}")
    if config is DECODE_CONFIG and num_splits > 1:
        config = DECODE_SPLIT_CONFIG  # same block_m, so num_tiles above still holds
    # One query token per request: token i is request i, so the merge can find its context length.
    decode_only = max_query_len <= 1 and num_tokens <= num_reqs

    if num_splits > 1:
        partial_out = torch.empty(num_tokens, num_heads, num_splits, dim_pad, dtype=torch.float32, device=q.device)
        partial_max = torch.empty(num_tokens, num_heads, num_splits, dtype=torch.float32, device=q.device)
        partial_sum = torch.empty_like(partial_max)
    else:
        partial_out = partial_max = partial_sum = out  # unused by the kernel in this mode

    _paged_attention_kernel[(num_tiles, num_kv_heads, num_splits)](
        out,
        partial_out,
        partial_max,
        partial_sum,
        q,
        kv_cache,
        kv_scale if kv_scale is not None else unit_kv_scales(q.device),
        block_table,
        seq_lens,
        query_start_loc,
        scale * _LOG2E,
        num_reqs,
        num_heads,
        head_dim,
        block_size,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        kv_cache.stride(3),
        block_table.stride(0),
        num_splits,
        NUM_Q_PER_KV=group,
        BLOCK_Q=block_q,
        BLOCK_M=block_m,
        TILE_N=config.tile_n,
        DIM_PAD=dim_pad,
        SPLIT_KV=num_splits > 1,
        DOT_PRECISION=_dot_precision(q.dtype),
        DECODE_ONLY=decode_only,
        MIN_SPLIT=_MIN_SPLIT_LEN,
        SOFTCAP=softcap_log2(softcap),
        WINDOW=window,
        sinks_ptr=sinks,
        HAS_SINKS=sinks is not None,
        CHUNK=chunk,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        **pdl_launch(q.device),
    )
    if num_splits > 1:
        _merge_splits_kernel[(num_tokens, num_heads)](
            out,
            partial_out,
            partial_max,
            partial_sum,
            num_heads,
            head_dim,
            out.stride(0),
            out.stride(1),
            num_splits,
            seq_lens,
            num_reqs,
            SPLIT_CHUNK=_MERGE_CHUNK,
            DIM_PAD=dim_pad,
            DECODE_ONLY=decode_only,
            TILE_N=config.tile_n,
            MIN_SPLIT=_MIN_SPLIT_LEN,
            **pdl_launch(q.device),
        )
    return out
