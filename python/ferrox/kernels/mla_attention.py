"""Multi-head latent attention (DeepSeek-V2 / V3 MLA, absorbed form) over the paged latent cache.

Each token's cache row is its latent [c_kv | k_pe]: DIM_LATENT (kv_lora_rank, 512) + DIM_ROPE
(qk_rope_head_dim, 64) dims, one "KV head" shared by every query head (models/mla_attention.py). A query
head h has the same 576 dims (q_nope_h absorbed through W_UK_h, then its rotated q_pe_h), and

    score(h, j) = q_h[:512] . row_j[:512] + q_h[512:] . row_j[512:]
    out_h       = softmax_j(score(h, j) * scale) @ row_j[:512]        (the value is the latent itself)

So the kernel reads ONLY the K plane (kv_cache[0]): each K tile's first DIM_LATENT columns are both the
keys' latent part and the values. 576 is not a power of two: the score is two dots (512 + 64), never one
padded to 1024, and the 512 columns are loaded once per tile for both dots.

Layout and metadata as kernels/paged_attention.py (the ordinary unified attention): one launch for a
mixed step (prefill chunks over cached context and one-token decodes), request r's queries rows
query_start_loc[r]:query_start_loc[r + 1], attending causally over seq_lens[r] positions whose blocks are
block_table[r]; query i of a request of query_len tokens sits at position seq_len - query_len + i. Query
tiles are numbered without a host sync (request r's tiles start at query_start_loc[r] // BLOCK_Q + r, so
the grid is num_tokens // BLOCK_Q + num_reqs tiles and a program finds its request by binary search).

A program holds BLOCK_M query rows: BLOCK_Q tokens x HEAD_TILE heads (row m = token m // HEAD_TILE, head
m % HEAD_TILE of the tile's heads), so every K tile it loads feeds BLOCK_M rows of both dots (a decode
of V3's 128 heads: 32 heads a program, each latent tile read by 4 programs, launched side by side so
that mostly L2 serves the repeats). The grid is (query tiles x head tiles, splits). Online softmax in
fp32, accumulator [BLOCK_M, DIM_LATENT] fp32.

Split-KV (decode of few requests over long contexts): the KV range of each request is cut into
num_splits segments of whole TILE_N steps, each written as a partial (normalised output, max, sum) and
merged by a second kernel. Partials cost H x 512 x 4 bytes each way per split (V3: 256 KB, the latent of
~230 positions), so a split is at least `min_split_len(num_heads)` positions and the split count aims at
one wave of programs. A decode-only batch's splits are at least MIN_SPLIT long, so a CUDA graph captured
for max_model_len replays short contexts in fewer live splits; a request with one live split (or a pad
row, seq_len 0: zeros) is written by the attention kernel itself and skipped by the merge.

Graph safety: launch sizes depend only on q's rows, the request count, max_query_len and max_seq_len (a
CUDA graph fixes the last to max_model_len); nothing reads device data on the host.

FP8 cache (float8_e4m3fn): rows are stored as latent / k_scale (write_latent); the kernel widens tiles to
q's dtype, folds k_scale into the softmax scale and multiplies the output by it (the value is the same
stored row, so it carries the same scale).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ferrox.kernels.kv_fp8 import FP8_KV_DTYPE, unit_kv_scales
from ferrox.kernels.paged_attention import _find_request, _split_len  # (the same tile and split rules)
from ferrox.kernels.pdl import pdl_launch, pdl_launch_dependents, pdl_wait
from ferrox.kernels.reshape_and_cache import quantize_kv_fp8
from ferrox.kernels.split_k import num_sms as _num_sms

_LOG2E = 1.4426950408889634


def graph_capturing(t: torch.Tensor) -> bool:
    """Whether t's device is capturing a CUDA graph now (a step planned then must not keep device tensors
    of the capture's own; models/mla_attention.py)."""
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


@triton.jit(do_not_specialize=["num_reqs", "stride_bt", "num_splits"])
def _mla_attention_kernel(
    out_ptr,
    partial_out_ptr,
    partial_max_ptr,
    partial_sum_ptr,
    q_ptr,
    cache_ptr,  # the K plane [blocks, block_size, 1, D]
    kv_scale_ptr,
    block_table_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    scale_log2,
    num_reqs,
    num_heads,
    num_head_tiles,
    block_size,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_cblock,
    stride_cslot,
    stride_bt,
    num_splits,
    DIM_LATENT: tl.constexpr,  # kv_lora_rank: the value dims, first in the row
    DIM_ROPE: tl.constexpr,  # qk_rope_head_dim, after them
    LATENT_PAD: tl.constexpr,
    ROPE_PAD: tl.constexpr,
    HEAD_TILE: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    TILE_N: tl.constexpr,
    SPLIT_KV: tl.constexpr,
    DECODE_ONLY: tl.constexpr,
    MIN_SPLIT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_launch_dependents(USE_PDL)
    # Axis 0 is (query tile, head tile) with the head tile fastest: the programs that read the same
    # latent rows are launched together (their second reads mostly hit L2).
    tile_id = tl.program_id(0) // num_head_tiles
    head_tile = tl.program_id(0) % num_head_tiles
    split = tl.program_id(1)
    pdl_wait(USE_PDL)

    req = _find_request(query_start_loc_ptr, num_reqs, tile_id, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + req)
    query_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    q_tile = tile_id - (q_start // BLOCK_Q + req)
    if q_tile * BLOCK_Q >= query_len:
        return
    seq_len = tl.load(seq_lens_ptr + req)
    context_len = seq_len - query_len

    rows = tl.arange(0, BLOCK_M)
    q_local = q_tile * BLOCK_Q + rows // HEAD_TILE
    head = head_tile * HEAD_TILE + rows % HEAD_TILE
    row_valid = (rows < BLOCK_Q * HEAD_TILE) & (q_local < query_len) & (head < num_heads)
    token = (q_start + q_local).to(tl.int64)
    q_pos = context_len + q_local
    lat = tl.arange(0, LATENT_PAD)
    rope = tl.arange(0, ROPE_PAD)
    lat_valid = lat < DIM_LATENT
    rope_valid = rope < DIM_ROPE

    q_row = q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh
    q_nope = tl.load(q_row + lat[None, :], mask=row_valid[:, None] & lat_valid[None, :], other=0.0)
    q_pe = tl.load(q_row + DIM_LATENT + rope[None, :], mask=row_valid[:, None] & rope_valid[None, :], other=0.0)
    FP8_KV: tl.constexpr = cache_ptr.dtype.element_ty == tl.float8e4nv
    if FP8_KV:
        scale_log2 = scale_log2 * tl.load(kv_scale_ptr)

    # Causal: nothing past this tile's last query is visible.
    kv_end = tl.minimum(seq_len, context_len + tl.minimum((q_tile + 1) * BLOCK_Q, query_len))
    alone = seq_len < 0  # (a runtime False: this program's split is its request's only one)
    if SPLIT_KV:
        split_len = _split_len(seq_len, num_splits, TILE_N, MIN_SPLIT, DECODE_ONLY)
        if DECODE_ONLY:
            live = tl.cdiv(seq_len, split_len)
            if split >= tl.maximum(live, 1):
                return  # past the context: the merge reads only live splits
            alone = live <= 1
        kv_lo = split * split_len
        kv_hi = tl.minimum(kv_end, kv_lo + split_len)
    else:
        kv_lo = 0
        kv_hi = kv_end

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, LATENT_PAD], tl.float32)
    cols = tl.arange(0, TILE_N)
    block_row = block_table_ptr + req.to(tl.int64) * stride_bt
    for start in range(kv_lo, kv_hi, TILE_N):
        pos = start + cols
        pos_valid = pos < kv_hi
        block = tl.load(block_row + pos // block_size, mask=pos_valid, other=0)
        slot = cache_ptr + block.to(tl.int64) * stride_cblock + (pos % block_size) * stride_cslot
        # One load of the latent columns serves as keys (first dot) and values (the accumulation).
        latent = tl.load(slot[:, None] + lat[None, :], mask=pos_valid[:, None] & lat_valid[None, :],
                         other=0.0).to(q_nope.dtype)
        k_pe = tl.load(slot[:, None] + DIM_LATENT + rope[None, :], mask=pos_valid[:, None] & rope_valid[None, :],
                       other=0.0).to(q_pe.dtype)
        s = tl.dot(q_pe, tl.trans(k_pe), input_precision=DOT_PRECISION)
        s = tl.dot(q_nope, tl.trans(latent), s, input_precision=DOT_PRECISION) * scale_log2
        visible = pos_valid[None, :] & (pos[None, :] <= q_pos[:, None])
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row with nothing visible yet keeps max -inf; subtract 0 instead so exp2 gives 0, not NaN.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(latent.dtype), latent, input_precision=DOT_PRECISION)
        m_i = m_new

    result = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    if FP8_KV:
        result = result * tl.load(kv_scale_ptr)  # the value is the K plane: k_scale
    if SPLIT_KV and not alone:
        partial = (token * num_heads + head) * num_splits + split
        tl.store(partial_out_ptr + partial[:, None] * LATENT_PAD + lat[None, :], result, mask=row_valid[:, None])
        tl.store(partial_max_ptr + partial, m_i, mask=row_valid)
        tl.store(partial_sum_ptr + partial, l_i, mask=row_valid)
    else:
        tl.store(out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + lat[None, :],
                 result.to(out_ptr.dtype.element_ty), mask=row_valid[:, None] & lat_valid[None, :])


@triton.jit(do_not_specialize=["num_splits", "num_reqs"])
def _mla_merge_kernel(
    out_ptr,
    partial_out_ptr,
    partial_max_ptr,
    partial_sum_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    num_reqs,
    num_heads,
    stride_ot,
    stride_oh,
    num_splits,
    DIM_LATENT: tl.constexpr,
    LATENT_PAD: tl.constexpr,
    SPLIT_CHUNK: tl.constexpr,
    DECODE_ONLY: tl.constexpr,
    TILE_N: tl.constexpr,
    MIN_SPLIT: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """out = sum_s w_s o_s / sum_s w_s, w_s = l_s 2^(m_s - max m), SPLIT_CHUNK partials a pass (their
    loads issued together), the running max rescaling the sums between passes."""
    pdl_launch_dependents(USE_PDL)
    pdl_wait(USE_PDL)
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    base = (token * num_heads + head) * num_splits
    live = num_splits
    if DECODE_ONLY:
        if token >= num_reqs:
            return
        seq_len = tl.load(seq_lens_ptr + token)
        live = tl.cdiv(seq_len, _split_len(seq_len, num_splits, TILE_N, MIN_SPLIT, DECODE_ONLY))
        if live <= 1:
            return  # written by the attention kernel itself
    elif token >= tl.load(query_start_loc_ptr + num_reqs):
        return  # a row past the step's tokens: its partials were never written
    splits = tl.arange(0, SPLIT_CHUNK)
    lat = tl.arange(0, LATENT_PAD)
    m_run = tl.max(tl.full([SPLIT_CHUNK], float("-inf"), tl.float32), 0)
    l_run = tl.sum(tl.zeros([SPLIT_CHUNK], tl.float32), 0)
    acc = tl.zeros([LATENT_PAD], tl.float32)
    for first in range(0, live, SPLIT_CHUNK):
        idx = first + splits
        used = idx < live
        m = tl.load(partial_max_ptr + base + idx, mask=used, other=float("-inf"))
        l_s = tl.load(partial_sum_ptr + base + idx, mask=used, other=0.0)
        o = tl.load(partial_out_ptr + (base + idx)[:, None] * LATENT_PAD + lat[None, :], mask=used[:, None],
                    other=0.0)
        m_new = tl.maximum(m_run, tl.max(m, 0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        weight = l_s * tl.exp2(m - m_safe)  # an empty split: l = 0, m = -inf -> 0
        alpha = tl.exp2(m_run - m_safe)
        acc = acc * alpha + tl.sum(o * weight[:, None], 0)
        l_run = l_run * alpha + tl.sum(weight, 0)
        m_run = m_new
    result = acc / tl.where(l_run == 0.0, 1.0, l_run)
    tl.store(out_ptr + token * stride_ot + head * stride_oh + lat, result.to(out_ptr.dtype.element_ty),
             mask=lat < DIM_LATENT)


@triton.jit
def _write_latent_kernel(rows_ptr, cache_ptr, slot_mapping_ptr, kv_scale_ptr, stride_rt, stride_cblock,
                         stride_cslot, block_size, dim, DIM_PAD: tl.constexpr):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token)
    if slot < 0:
        return  # padding (CUDA graphs) writes nothing
    dims = tl.arange(0, DIM_PAD)
    mask = dims < dim
    row = tl.load(rows_ptr + token * stride_rt + dims, mask=mask)
    if cache_ptr.dtype.element_ty == tl.float8e4nv:
        row = quantize_kv_fp8(row, tl.load(kv_scale_ptr))
    dst = cache_ptr + (slot // block_size).to(tl.int64) * stride_cblock + (slot % block_size) * stride_cslot
    tl.store(dst + dims, row.to(cache_ptr.dtype.element_ty), mask=mask)


def write_latent(latent: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                 kv_scale: torch.Tensor | None = None) -> None:
    """Store latent rows [T, 1, D] (or [T, D]) into the K plane of kv_cache [2, blocks, block_size, 1, D] at
    slot_mapping (slot -1: skipped); the V plane is not written (this kernel never reads it). kv_scale: an
    FP8 cache's float32 (k_scale, v_scale); the rows are stored as latent / k_scale."""
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2 or kv_cache.shape[3] != 1:
        raise ValueError(f"kv_cache must be [2, blocks, block_size, 1, D], got {tuple(kv_cache.shape)}")
    rows = latent.reshape(latent.shape[0], -1)
    dim = kv_cache.shape[4]
    if rows.shape[1] != dim or rows.stride(1) != 1 or kv_cache.stride(-1) != 1:
        raise ValueError(f"latent rows must be [T, {dim}] with contiguous dims, got {tuple(latent.shape)}")
    n = slot_mapping.shape[0]
    if n > rows.shape[0]:
        raise ValueError(f"slot_mapping has {n} slots for {rows.shape[0]} latent rows")
    if n == 0:
        return
    plane = kv_cache[0]
    _write_latent_kernel[(n,)](rows, plane, slot_mapping, kv_scale if kv_scale is not None else
                               unit_kv_scales(kv_cache.device), rows.stride(0), plane.stride(0), plane.stride(1),
                               kv_cache.shape[2], dim, DIM_PAD=triton.next_power_of_2(dim))


@dataclass(frozen=True, slots=True)
class MlaLaunchConfig:
    head_tile: int  # query heads a program holds (all share the one latent row)
    block_m: int  # rows of a program: tokens x heads, a power of two >= 16 and >= head_tile
    tile_n: int  # KV positions per inner step
    num_warps: int
    num_stages: int


# Chosen from benches/bench_mla.py --sweep on an H100 (2026-12-05, bf16, timed as the engine's decode graphs
# launch them: max_seq_len fixed to the model's bound, so a graph's config can depend on its batch only).
# Decode holds HEAD_TILE heads of one token a program: 16 / 32 heads with 64-position latent tiles over 8 warps
# when programs are few (latency-bound: V3's 128 heads, batch 1 at 32k 0.247 -> 0.096 ms with the split count
# below), 64 heads a program for big batches of many heads (each head tile re-reads the latent: 128 heads x
# batch 32 at 8k 0.95 -> 0.53 ms), and 16 heads over 4 warps with 32-position tiles for big batches of few heads
# (V2-Lite batch 32 at 32k 1.36 -> 0.51 ms). Prefill: 64 rows of tokens x 16 heads (Hopper's wgmma takes 64-row
# tiles) with 64-position tiles: 4k tokens at 128 heads 14.1 -> 10.7 ms (tile_n 128 does not fit shared memory).
# Compiled offline for sm_90a (ptxas -v): the [rows, 512] fp32 accumulator and the 512-wide q operand fill the
# registers (32 heads a program 255 registers and a few spilled bytes; 64 heads ~500 bytes, still the fastest
# at those batches).
SMALL_DECODE_CONFIG = MlaLaunchConfig(head_tile=32, block_m=32, tile_n=64, num_warps=8, num_stages=2)
FEW_HEADS_BATCH_CONFIG = MlaLaunchConfig(head_tile=16, block_m=16, tile_n=32, num_warps=4, num_stages=2)
MANY_HEADS_BATCH_CONFIG = MlaLaunchConfig(head_tile=64, block_m=64, tile_n=32, num_warps=8, num_stages=2)
PREFILL_CONFIG = MlaLaunchConfig(head_tile=16, block_m=64, tile_n=64, num_warps=8, num_stages=2)
# float32 (the engine's exactness tests): IEEE dots on the CUDA cores, tiles twice as wide in bytes; small
# and unpipelined, so that a 512-column fp32 tile fits in shared memory whatever Triton stages there.
FP32_CONFIG = MlaLaunchConfig(head_tile=16, block_m=16, tile_n=16, num_warps=8, num_stages=1)
# Programs per SM a split decode aims at: two rounds of programs hide the latent loads' latency better than
# one (sweep: V2-Lite batch 8 at 32k, 17 splits 0.37 ms, 32 splits 0.15 ms, 64 splits 0.16 ms), but never a
# few programs past them: a short last round costs a whole round (batch 32 at 32k, 8 splits 0.51 ms, 9 splits
# 0.80 ms), so the count rounds down.
_WAVES = 2


def choose_decode_config(num_heads: int, batch: int) -> MlaLaunchConfig:
    """The decode launch for `batch` one-token requests of num_heads heads (module comment above)."""
    if num_heads <= 16:
        return SMALL_DECODE_CONFIG if batch <= 8 else FEW_HEADS_BATCH_CONFIG
    return SMALL_DECODE_CONFIG if batch < 32 else MANY_HEADS_BATCH_CONFIG


_MIN_SEQ_FOR_SPLIT = 512
_MAX_SPLITS = 256
_SPLIT_CHUNK = 16


def _fit(config: MlaLaunchConfig, num_heads: int, decode: bool) -> tuple[int, int, int]:
    """(head_tile, block_m, block_q) of `config` for num_heads heads. A decode step's programs hold one
    token (more rows would be other requests' tokens, masked off) unless the heads fill less than 16 rows."""
    head_tile = min(config.head_tile, triton.next_power_of_2(num_heads))
    block_m = max(config.block_m, head_tile, 16)
    if decode:
        block_m = max(head_tile, 16)
    return head_tile, block_m, block_m // head_tile


def min_split_len(num_heads: int) -> int:
    """Shortest split (positions): its partials (num_heads x 512 fp32, written and read) stay under ~1/4
    of the latent bytes it streams (576 bf16 a position)."""
    return max(256, 8 * num_heads)


def choose_num_splits(num_programs: int, max_seq_len: int, num_heads: int, num_sms: int) -> int:
    """Split-KV count from host-known numbers only (graph-safe): _WAVES programs an SM, splits no shorter
    than min_split_len. num_programs: the programs with work (a decode step's tiles are its tokens)."""
    if max_seq_len < _MIN_SEQ_FOR_SPLIT or num_programs >= _WAVES * num_sms:
        return 1
    wanted = _WAVES * num_sms // max(num_programs, 1)
    return max(1, min(wanted, max_seq_len // min_split_len(num_heads), _MAX_SPLITS))


def _dot_precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"  # fp32 tests must not drop to tf32 on the GPU


def mla_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    *,
    kv_lora_rank: int,
    max_query_len: int,
    max_seq_len: int,
    scale: float,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
    config: MlaLaunchConfig | None = None,
    kv_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Latent attention of q [T, H, kv_lora_rank + rope] over kv_cache [2, blocks, block_size, 1, same]
    (rows already written; only kv_cache[0] is read). Returns [T, H, kv_lora_rank]: `out` when given (any
    [T, H, >= kv_lora_rank] view with a contiguous last axis; only its first kv_lora_rank columns are
    written), else a new tensor. query_start_loc / seq_lens / block_table: the AttentionMetadata device
    tensors; max_query_len / max_seq_len: host upper bounds that pick the launch shape. Rows past
    query_start_loc[-1] are left unwritten."""
    if q.dim() != 3 or q.stride(-1) != 1:
        raise ValueError(f"q must be [tokens, heads, dims] with contiguous dims, got {tuple(q.shape)}")
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2 or kv_cache.shape[3] != 1 or kv_cache.stride(-1) != 1:
        raise ValueError(f"kv_cache must be [2, blocks, block_size, 1, D] (one latent row a token), "
                         f"got {tuple(kv_cache.shape)}")
    num_tokens, num_heads, dim = q.shape
    if kv_cache.shape[4] != dim or not 0 < kv_lora_rank < dim:
        raise ValueError(f"q has {dim} dims, the cache rows {kv_cache.shape[4]}; kv_lora_rank {kv_lora_rank}")
    if kv_cache.dtype != q.dtype and kv_cache.dtype != FP8_KV_DTYPE:
        raise ValueError(f"kv_cache dtype {kv_cache.dtype} must be q's ({q.dtype}) or {FP8_KV_DTYPE}")
    if kv_scale is not None and (kv_scale.dtype != torch.float32 or kv_scale.numel() != 2):
        raise ValueError(f"kv_scale must be float32 (k_scale, v_scale), got {kv_scale.dtype} {tuple(kv_scale.shape)}")
    rope_dim = dim - kv_lora_rank
    if out is None:
        out = torch.empty(num_tokens, num_heads, kv_lora_rank, dtype=q.dtype, device=q.device)
    elif out.shape[:2] != q.shape[:2] or out.shape[2] < kv_lora_rank or out.stride(-1) != 1:
        raise ValueError(f"out must be [{num_tokens}, {num_heads}, >= {kv_lora_rank}], got {tuple(out.shape)}")
    num_reqs = seq_lens.shape[0]
    if num_tokens == 0 or num_reqs == 0:
        return out[..., :kv_lora_rank]

    decode_only = max_query_len <= 1 and num_tokens <= num_reqs  # token i is request i
    if config is None:
        config = (FP32_CONFIG if q.element_size() > 2 else choose_decode_config(num_heads, num_tokens)
                  if max_query_len <= 1 else PREFILL_CONFIG)
    head_tile, block_m, block_q = _fit(config, num_heads, max_query_len <= 1)
    head_tiles = triton.cdiv(num_heads, head_tile)
    num_tiles = num_tokens // block_q + num_reqs
    if num_splits is None:
        # (a decode-only step's tiles past its tokens hold no rows: they exit at once)
        working = num_tokens if decode_only and block_q == 1 else num_tiles
        num_splits = choose_num_splits(working * head_tiles, max_seq_len, num_heads, _num_sms(q.device))
    if not 1 <= num_splits <= _MAX_SPLITS:
        raise ValueError(f"num_splits must be in 1..{_MAX_SPLITS}, got {num_splits}")
    latent_pad = triton.next_power_of_2(kv_lora_rank)
    min_split = max(min_split_len(num_heads), config.tile_n)
    if num_splits > 1:
        partial_out = torch.empty(num_tokens, num_heads, num_splits, latent_pad, dtype=torch.float32, device=q.device)
        partial_max = torch.empty(num_tokens, num_heads, num_splits, dtype=torch.float32, device=q.device)
        partial_sum = torch.empty_like(partial_max)
    else:
        partial_out = partial_max = partial_sum = out  # unused in this mode
    plane = kv_cache[0]
    _mla_attention_kernel[(num_tiles * head_tiles, num_splits)](
        out, partial_out, partial_max, partial_sum, q, plane,
        kv_scale if kv_scale is not None else unit_kv_scales(q.device),
        block_table, seq_lens, query_start_loc, scale * _LOG2E, num_reqs, num_heads, head_tiles, kv_cache.shape[2],
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), plane.stride(0), plane.stride(1),
        block_table.stride(0), num_splits,
        DIM_LATENT=kv_lora_rank, DIM_ROPE=rope_dim, LATENT_PAD=latent_pad,
        ROPE_PAD=max(triton.next_power_of_2(rope_dim), 16), HEAD_TILE=head_tile, BLOCK_Q=block_q, BLOCK_M=block_m,
        TILE_N=config.tile_n, SPLIT_KV=num_splits > 1, DECODE_ONLY=decode_only, MIN_SPLIT=min_split,
        DOT_PRECISION=_dot_precision(q.dtype), num_warps=config.num_warps, num_stages=config.num_stages,
        **pdl_launch(q.device),
    )
    if num_splits > 1:
        _mla_merge_kernel[(num_tokens, num_heads)](
            out, partial_out, partial_max, partial_sum, seq_lens, query_start_loc, num_reqs, num_heads, out.stride(0), out.stride(1),
            num_splits, DIM_LATENT=kv_lora_rank, LATENT_PAD=latent_pad, SPLIT_CHUNK=_SPLIT_CHUNK,
            DECODE_ONLY=decode_only, TILE_N=config.tile_n, MIN_SPLIT=min_split, num_warps=4,
            **pdl_launch(q.device),
        )
    return out[..., :kv_lora_rank]
