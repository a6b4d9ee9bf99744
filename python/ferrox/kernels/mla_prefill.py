"""DeepSeek's latent attention (MLA) for long prefill chunks, expanded, through FlashAttention-3 (Hopper).

Why: the absorbed form (models/mla_attention.py, kernels/mla_attention.py) scores every query head
against 576-dim latent rows and sums 512-dim latent values: 2 x (576 + 512) = 2,176 FLOPs a head and a
key. That is the right trade for decoding (one query a key: the cache is read once, never expanded), not
for a prefill chunk, where each key meets thousands of queries. Expanded, a cached latent row becomes
each head's own key and value again,

    k_h = [W_UK_h c_kv | k_pe]   (qk_nope + qk_rope dims: 192 for V2 / V3)
    v_h = W_UV_h c_kv            (v_head_dim: 128)

at one GEMM over the keys ([S, kv_lora_rank] x [kv_lora_rank, H x (nope + v)]), and attention costs
2 x (192 + 128) = 640 FLOPs a head and key, in FlashAttention-3's 192 / 128 kernel: 3.4x fewer FLOPs
on a kernel that runs ~2-3x the absorbed Triton kernel's rate. vLLM prefills MLA the same way.

One request's chunk at a time. The chunk over its own rows (read back from the cache, as the absorbed
kernel reads them) is attended causally; its cached context in slices whose expanded K/V stay under
SLICE_BYTES (the whole context expanded would be ~4 GB at V3's 128 heads x 32k tokens), each unmasked;
the parts are merged by their log-sum-exps in float32 (torch ops: nothing to compile after ready). An
FP8 cache's rows are widened exactly and multiplied by k_scale (the latent is both key and value).

Which requests (`plan_expanded`): chunks of at least EXPANDED_MIN_LEN tokens in an eager step.
Captured steps (the decode graphs, the piecewise graphs of steps up to a few thousand tokens) keep the
absorbed kernels they were captured with, and so does everything on CPU, or without the fa3-fwd wheel,
or with FERROX_FA3_PREFILL=0. The model's attention (models/mla_attention.py) attends the other
requests of the step absorbed and these here. Tests: tests/kernels/test_mla_prefill.py (the expansion,
slices and merge on CPU with the kernel replaced by a float64 softmax, against the absorbed torch
reference; the real kernel on an H100/H200) and the DeepSeek engine tests.
"""

from __future__ import annotations

import logging

import torch

from ferrox.kernels import fa3_prefill
from ferrox.kernels.cudnn_prefill import gather_blocks
from ferrox.kernels.kv_fp8 import FP8_KV_DTYPE

logger = logging.getLogger(__name__)

# Chunks shorter than this stay absorbed: the expansion's GEMM over the keys (nope + v = 256 outputs a
# head) costs about what ~170 query rows save, so from a few hundred rows on the expanded form wins.
EXPANDED_MIN_LEN = 512
# The most expanded K/V (bytes) one slice of a cached context holds: 26k positions of V2-Lite's 16 heads,
# 3.3k of V3's 128.
SLICE_BYTES = 256 << 20
# FlashAttention-3 head-dim pairs (q/k, v) other than equal ones: DeepSeek's.
_HEAD_DIM_PAIRS = {(192, 128)}


def expanded_supported(device: torch.device, dtype: torch.dtype, kv_dtype: torch.dtype, qk_head_dim: int,
                       v_head_dim: int) -> bool:
    """Whether a model of these MLA head dims, dtype and cache dtype on this device can take the path."""
    if qk_head_dim != v_head_dim and (qk_head_dim, v_head_dim) not in _HEAD_DIM_PAIRS:
        return False
    return kv_dtype in (dtype, FP8_KV_DTYPE) and fa3_prefill.fa3_prefill_supported(device, dtype, qk_head_dim)


def plan_expanded(meta) -> tuple[tuple[int, int, int, int], ...]:
    """(request, first row, row past it, cached context length) of each chunk of this step long enough for
    the expanded form, from the metadata's host copies."""
    if meta.max_query_len < EXPANDED_MIN_LEN:
        return ()
    starts = meta.query_start_loc_cpu.tolist()
    seq_lens = meta.seq_lens_cpu.tolist()
    spans = enumerate(zip(starts[:-1], starts[1:], strict=True))
    return tuple((r, a, b, seq_lens[r] - (b - a)) for r, (a, b) in spans if b - a >= EXPANDED_MIN_LEN)


def _latent_rows(kv_cache: torch.Tensor, block_ids: torch.Tensor, start: int, stop: int, dtype: torch.dtype,
                 k_scale: float) -> torch.Tensor:
    """Cached latent rows [stop - start, D] of positions start..stop (block_ids: the request's blocks from
    position 0), in `dtype`; an FP8 cache's widened and scaled (gathered as bytes: index kernels need not
    know the type)."""
    plane = kv_cache[:1]  # the latent (both "planes" of the backends' view are this one)
    block_size, dim = plane.shape[2], plane.shape[-1]
    first, past = start // block_size, -(-stop // block_size)
    fp8 = plane.dtype == FP8_KV_DTYPE
    rows = gather_blocks(plane.view(torch.uint8) if fp8 else plane, block_ids[first:past]).view(-1, dim)
    offset = start - first * block_size
    rows = rows[offset:offset + stop - start]
    if fp8:
        rows = rows.view(FP8_KV_DTYPE).to(dtype)
        if k_scale != 1.0:
            rows.mul_(k_scale)
    return rows


def _expand(rows: torch.Tensor, w_kv: torch.Tensor, num_heads: int, nope: int, rank: int):
    """Latent rows [S, rank + rope] -> each head's key [S, H, nope + rope] and value [S, H, v]."""
    kv = (rows[:, :rank] @ w_kv.t()).view(rows.shape[0], num_heads, -1)  # [S, H, nope + v]
    k_pe = rows[:, None, rank:].expand(-1, num_heads, -1)
    return torch.cat((kv[..., :nope], k_pe), dim=-1), kv[..., nope:]


def _merge_into(acc: torch.Tensor, acc_lse: torch.Tensor, part: torch.Tensor, part_lse: torch.Tensor) -> None:
    """acc [T, H, Dv] (float32), acc_lse [H, T] <- the softmax-weighted union with part over disjoint keys."""
    merged = torch.logaddexp(acc_lse, part_lse)
    acc.mul_(torch.exp(acc_lse - merged).t()[..., None])
    acc.add_(part.float() * torch.exp(part_lse - merged).t()[..., None])
    acc_lse.copy_(merged)


def mla_prefill_request(out: torch.Tensor, q_nope: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor,
                        block_ids: torch.Tensor, context_len: int, w_uk: torch.Tensor, w_uv: torch.Tensor,
                        scale: float, k_scale: float = 1.0) -> None:
    """One request's chunk, expanded: q_nope [T, H, nope], q_pe [T, H, rope] (rotated as the cache's k_pe),
    the latent cache (its rows for positions 0 .. context_len + T written, block_ids covering them),
    w_uk [H, nope, rank] and w_uv [H, rank, v] (the layer's halves of kv_b_proj); writes out [T, H, v] (any
    strides), the heads' outputs before o_proj."""
    t, num_heads, nope = q_nope.shape
    rank = w_uk.shape[2]
    dtype = q_nope.dtype
    # kv_b_proj's rows again, per head [nope | v] (~4 MB a layer at 16 heads; made per call, not kept).
    w_kv = torch.cat((w_uk, w_uv.transpose(1, 2)), dim=1).reshape(-1, rank)
    q = torch.cat((q_nope, q_pe.to(dtype)), dim=-1).unsqueeze(0)  # [1, T, H, nope + rope]
    k, v = _expand(_latent_rows(kv_cache, block_ids, context_len, context_len + t, dtype, k_scale), w_kv,
                   num_heads, nope, rank)
    own, own_lse = fa3_prefill._fwd(q, k.unsqueeze(0), v.unsqueeze(0), scale, True)
    if context_len == 0:
        out.copy_(own[0])
        return
    acc, acc_lse = own[0].float(), own_lse[0].clone()
    row_bytes = num_heads * (w_kv.shape[0] // num_heads + k.shape[-1]) * torch.empty((), dtype=dtype).element_size()
    block_size = kv_cache.shape[2]
    slice_len = max(block_size, SLICE_BYTES // row_bytes // block_size * block_size)
    for start in range(0, context_len, slice_len):
        stop = min(start + slice_len, context_len)
        k, v = _expand(_latent_rows(kv_cache, block_ids, start, stop, dtype, k_scale), w_kv, num_heads, nope, rank)
        part, part_lse = fa3_prefill._fwd(q, k.unsqueeze(0), v.unsqueeze(0), scale, False)
        _merge_into(acc, acc_lse, part[0], part_lse[0])
    out.copy_(acc)


def scratch_bytes(num_heads: int, qk_head_dim: int, nope: int, v_head_dim: int, element_size: int,
                  max_query_len: int) -> int:
    """Device memory one layer's expanded prefill holds beyond the absorbed path's (which the profiling
    forward measured), for the KV budget (worker/model_setup.py): the chunk's query, its own rows expanded,
    the parts and the float32 accumulator, and a context slice's expanded K/V twice (k copied by the cat)."""
    if max_query_len < EXPANDED_MIN_LEN:
        return 0
    per_row = num_heads * ((2 * qk_head_dim + nope + 2 * v_head_dim) * element_size + 2 * v_head_dim * 4 + 8)
    return max_query_len * per_row + 2 * SLICE_BYTES


def warm_up(device: torch.device, dtype: torch.dtype, num_heads: int, qk_head_dim: int, v_head_dim: int) -> int:
    """Load the kernels the path calls (causal and unmasked, these head dims) before ready; returns the
    number of calls."""
    t = EXPANDED_MIN_LEN
    q = torch.zeros(1, t, num_heads, qk_head_dim, dtype=dtype, device=device)
    k = torch.zeros(1, 2 * t, num_heads, qk_head_dim, dtype=dtype, device=device)
    v = torch.zeros(1, 2 * t, num_heads, v_head_dim, dtype=dtype, device=device)
    fa3_prefill._fwd(q, k[:, :t], v[:, :t], qk_head_dim ** -0.5, True)
    fa3_prefill._fwd(q, k, v, qk_head_dim ** -0.5, False)
    torch.cuda.synchronize(device)
    return 2
