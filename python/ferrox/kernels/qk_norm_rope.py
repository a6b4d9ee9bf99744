"""Qwen3's per-head q/k RMSNorm and rotary in one launch: with the KV-cache write for one decode
token (`qk_norm_rope_cache`), and for the many tokens of a prefill or mixed step (`qk_norm_rope`).

The one-token qkv kernel (gemv.py `qkv_rope_gemv`) rotates q and k in its epilogue, where a program
holds a few rotary pairs of a head. Qwen3 normalises each q and k head over its whole head_dim
between the projection and rotary, and splitting a head's rows over programs is what lets the
projection stream at bandwidth, so the norm cannot sit there. Its layers run the projection as a
plain GEMV and then this kernel: one program per head, the head's head_dim outputs in registers.

Without the norms (QK_NORM off) it is the rotary + KV write of an int4 layer's qkv: the int4 GEMV
(int4_matmul.py, input norm in its prologue) has no rotary epilogue, its programs own runs of
consecutive rows, not the rotary pairs (d, d + head_dim / 2), so those layers also take this second
launch. Any even head_dim then, as `qkv_rope_gemv` takes (lanes padded to a power of two).

The arithmetic follows the unfused layers: RMSNorm's two roundings to the activation dtype (the
normed head, then times the weight), rotary in float32 on that, k and v stored as qkv_rope_gemv
stores them.

A step of many tokens (prefill, mixed batches) projects qkv with a GEMM and had, per layer, two
torch RMSNorms over 3-D head views and the torch rotary formula: ~25 small launches, and a host-bound
prefill on a GPU as fast as an H200. `qk_norm_rope` is that sequence in one launch, one program per
(token, head), returning q and k for the attention backend (which writes the cache itself). Both
kernels run the same `_norm_rotate_head`, so a prompt's tokens and its decoded tokens are normed and
rotated with the same roundings.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ferrox.kernels.kv_fp8 import unit_kv_scales
from ferrox.kernels.pdl import pdl_launch, pdl_wait
from ferrox.kernels.reshape_and_cache import store_head_kv


@triton.jit
def _norm_rotate_head(
    src,  # the head's first activation: HEAD_DIM of them, contiguous
    rope,  # its token's [cos | sin] row, float32, HALF each
    q_norm_ptr,
    k_norm_ptr,
    is_q,  # the head is a q head: normed with q_norm's weight
    is_k,  # a k head: k_norm's (neither, e.g. a v head: weight 0, the caller keeps what it loaded)
    eps,
    HEAD_DIM: tl.constexpr,
    QK_NORM: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    """The per-head math of both kernels below, written once so prefill and decode cannot drift.
    Loads one head as its two rotary halves (lanes past HEAD_DIM / 2 hold 0), RMS-norms it over the
    head (QK_NORM) with RMSNorm's two roundings to the activation dtype, and rotates that neox-style
    in float32. Returns (lo, hi) as loaded and the rotated (lo, hi), all float32, not yet rounded."""
    HALF: tl.constexpr = HEAD_DIM // 2
    pairs = tl.arange(0, BLOCK_HALF)
    lanes = pairs < HALF
    lo = tl.load(src + pairs, mask=lanes, other=0.0).to(tl.float32)
    hi = tl.load(src + HALF + pairs, mask=lanes, other=0.0).to(tl.float32)
    n_lo, n_hi = lo, hi
    if QK_NORM:
        # Each head reads only its own norm weight. Scalar conditions become row limits (a block
        # mask must come from a block comparison).
        q_rows = pairs < tl.where(is_q, HALF, 0)
        k_rows = pairs < tl.where(is_k, HALF, 0)
        w_lo = (tl.load(q_norm_ptr + pairs, mask=q_rows, other=0.0).to(tl.float32)
                + tl.load(k_norm_ptr + pairs, mask=k_rows, other=0.0).to(tl.float32))
        w_hi = (tl.load(q_norm_ptr + HALF + pairs, mask=q_rows, other=0.0).to(tl.float32)
                + tl.load(k_norm_ptr + HALF + pairs, mask=k_rows, other=0.0).to(tl.float32))
        rstd = tl.rsqrt((tl.sum(lo * lo, axis=0) + tl.sum(hi * hi, axis=0)) / HEAD_DIM + eps)
        # RMSNorm's roundings: the normed head to the activation dtype, then times the weight, rounded.
        n_lo = (lo * rstd).to(src.dtype.element_ty).to(tl.float32)
        n_hi = (hi * rstd).to(src.dtype.element_ty).to(tl.float32)
        n_lo = (w_lo * n_lo).to(src.dtype.element_ty).to(tl.float32)
        n_hi = (w_hi * n_hi).to(src.dtype.element_ty).to(tl.float32)

    cos = tl.load(rope + pairs, mask=lanes, other=1.0)
    sin = tl.load(rope + HALF + pairs, mask=lanes, other=0.0)
    return lo, hi, n_lo * cos - n_hi * sin, n_hi * cos + n_lo * sin


@triton.jit
def _qk_norm_rope_cache_kernel(
    q_out_ptr,
    cache_ptr,
    qkv_ptr,
    q_norm_ptr,
    k_norm_ptr,
    eps,
    rope_ptr,  # this token's [cos | sin] row, float32, HALF each
    slot_ptr,
    kv_scale_ptr,  # float32 (k_scale, v_scale) of an FP8 cache
    num_q_heads,
    num_kv_heads,
    block_size,
    stride_ckv,
    stride_cblock,
    stride_cslot,
    stride_chead,
    HEAD_DIM: tl.constexpr,
    QK_NORM: tl.constexpr,  # False: rotary and the KV write only (an int4 layer's qkv)
    BLOCK_HALF: tl.constexpr,  # HEAD_DIM / 2 rounded up to a power of two (the lanes)
    USE_PDL: tl.constexpr,  # launched with programmatic dependent launch (pdl.py)
):
    """One program: one whole head of the projected qkv row, as its two rotary halves. q and k
    heads are RMS-normed over the head (QK_NORM; rounded as RMSNorm stores its output) and rotated;
    q goes to q_out, k and v (unchanged) into the paged cache at this token's slot."""
    HALF: tl.constexpr = HEAD_DIM // 2
    # No pdl_launch_dependents: attention, which reads what this kernel writes, starts as its programs
    # exit (pdl.py says why).
    pdl_wait(USE_PDL)
    head = tl.program_id(0)
    pairs = tl.arange(0, BLOCK_HALF)
    is_q = head < num_q_heads
    is_v = head >= num_q_heads + num_kv_heads
    lo, hi, rot_lo, rot_hi = _norm_rotate_head(qkv_ptr + head * HEAD_DIM, rope_ptr, q_norm_ptr, k_norm_ptr,
                                               is_q, ~is_q & ~is_v, eps, HEAD_DIM, QK_NORM, BLOCK_HALF)
    # v is neither normed nor rotated: selected, not multiplied by (cos, sin) = (1, 0), so an inf
    # in v stays an inf.
    out_lo = tl.where(is_v, lo, rot_lo).to(q_out_ptr.dtype.element_ty)
    out_hi = tl.where(is_v, hi, rot_hi).to(q_out_ptr.dtype.element_ty)

    # Scalar conditions become row limits (a block mask must come from a block comparison).
    q_mask = pairs < tl.where(is_q, HALF, 0)
    tl.store(q_out_ptr + head * HEAD_DIM + pairs, out_lo, mask=q_mask)
    tl.store(q_out_ptr + head * HEAD_DIM + HALF + pairs, out_hi, mask=q_mask)

    store_head_kv(cache_ptr, kv_scale_ptr, slot_ptr, head, pairs, out_lo, out_hi, num_q_heads, num_kv_heads,
                  block_size, stride_ckv, stride_cblock, stride_cslot, stride_chead, HALF)


_ACTIVATION_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def qk_norm_rope_cache(
    qkv: torch.Tensor,
    *,
    q_norm_weight: torch.Tensor | None,
    k_norm_weight: torch.Tensor | None,
    eps: float,
    rope_row: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_cache: torch.Tensor,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    kv_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Qwen3's per-head q/k RMSNorm, then rotary and the KV-cache write, for one token's projected
    qkv [1, (Hq + 2 Hkv) * D] (rows [q | k | v], e.g. from `gemv` with the input norm). The norm
    needs a whole head's outputs, and a `_qkv_rope_kernel` program holds only a few of a head's
    rotary pairs, so it cannot sit in the projection's epilogue: this is the second launch, one
    program per head. Rotary, cache layout, slot -1 and the FP8 cache (kv_scale) as
    `qkv_rope_gemv`. Returns q [1, Hq, D].

    Both norm weights None: no norms, rotary and the KV write only (an int4 layer's qkv, from
    `int4_gemv` with the input norm; the module docstring says why), for any even head_dim."""
    heads = num_q_heads + 2 * num_kv_heads
    if (q_norm_weight is None) != (k_norm_weight is None):
        raise ValueError("give both q and k norm weights, or neither")
    qk_norm = q_norm_weight is not None
    if qkv.dtype not in _ACTIVATION_DTYPES:
        raise ValueError(f"qkv must be float32, float16 or bfloat16, got {qkv.dtype}")
    if qk_norm and (head_dim < 2 or head_dim > 256 or head_dim & (head_dim - 1)):
        raise ValueError(f"head_dim must be a power of two in [2, 256], got {head_dim}")
    if not qk_norm and (head_dim < 2 or head_dim > 512 or head_dim % 2):
        raise ValueError(f"head_dim must be even, in [2, 512], got {head_dim}")
    if num_q_heads < 1 or num_kv_heads < 1:
        raise ValueError(f"need at least one q and one kv head, got {num_q_heads} / {num_kv_heads}")
    if qkv.dim() != 2 or qkv.shape != (1, heads * head_dim) or qkv.stride(-1) != 1:
        raise ValueError(f"qkv must be a contiguous [1, {heads * head_dim}] row ({heads} heads x {head_dim}), "
                         f"got {tuple(qkv.shape)} (strides {qkv.stride()})")
    if q_norm_weight is not None and k_norm_weight is not None:
        for name, w in (("q_norm_weight", q_norm_weight), ("k_norm_weight", k_norm_weight)):
            if w.shape != (head_dim,) or w.stride(0) != 1 or w.dtype not in _ACTIVATION_DTYPES:
                raise ValueError(f"{name} must be a contiguous float [{head_dim}], got {w.dtype} {tuple(w.shape)}")
    if rope_row.shape != (head_dim,) or rope_row.dtype != torch.float32 or rope_row.stride(0) != 1:
        raise ValueError(f"rope_row must be contiguous float32 [cos | sin] of width {head_dim}, "
                         f"got {rope_row.dtype} {tuple(rope_row.shape)}")
    if slot_mapping.numel() < 1 or slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slot_mapping must hold an int32/int64 slot, got {slot_mapping.dtype} "
                         f"{tuple(slot_mapping.shape)}")
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2 or kv_cache.shape[3:] != (num_kv_heads, head_dim) \
            or kv_cache.stride(-1) != 1:
        raise ValueError(f"kv_cache must be [2, blocks, block_size, {num_kv_heads}, {head_dim}], "
                         f"got {tuple(kv_cache.shape)} (strides {kv_cache.stride()})")
    if kv_cache.dtype not in (qkv.dtype, torch.float8_e4m3fn):
        raise ValueError(f"kv_cache must be {qkv.dtype} or float8_e4m3fn, got {kv_cache.dtype}")
    if kv_scale is not None and (kv_scale.dtype != torch.float32 or kv_scale.numel() != 2):
        raise ValueError(f"kv_scale must be float32 (k_scale, v_scale), got {kv_scale.dtype} "
                         f"{tuple(kv_scale.shape)}")
    q = torch.empty(1, num_q_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    _qk_norm_rope_cache_kernel[(heads,)](
        q, kv_cache, qkv, q_norm_weight if q_norm_weight is not None else qkv,
        k_norm_weight if k_norm_weight is not None else qkv, eps, rope_row, slot_mapping,
        kv_scale if kv_scale is not None else unit_kv_scales(qkv.device),
        num_q_heads, num_kv_heads, kv_cache.shape[2], kv_cache.stride(0), kv_cache.stride(1),
        kv_cache.stride(2), kv_cache.stride(3),
        HEAD_DIM=head_dim, QK_NORM=qk_norm, BLOCK_HALF=triton.next_power_of_2(head_dim // 2),
        num_warps=1 if head_dim <= 128 else 2, **pdl_launch(qkv.device),
    )
    return q


@triton.jit
def _qk_norm_rope_kernel(
    q_out_ptr,  # [T, num_q_heads, HEAD_DIM], contiguous
    k_out_ptr,  # [T, num_kv_heads, HEAD_DIM], contiguous
    qkv_ptr,
    q_norm_ptr,
    k_norm_ptr,
    eps,
    rope_ptr,  # [R, HEAD_DIM] float32 rows of [cos | sin]
    rope_index_ptr,  # [T]: token t rotates by row rope_index[t]
    stride_qkv,
    stride_rope,
    num_q_heads,
    num_kv_heads,
    HEAD_DIM: tl.constexpr,
    BLOCK_HALF: tl.constexpr,  # HEAD_DIM / 2 rounded up to a power of two (the lanes)
):
    """One program: one q or k head of one token, as the one-token kernel's programs; v heads have
    none. Tokens on grid axis 0 (axis 1 holds at most 65,535), and their count is no argument: a
    new prompt length compiles nothing."""
    HALF: tl.constexpr = HEAD_DIM // 2
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    is_q = head < num_q_heads
    row = tl.load(rope_index_ptr + token).to(tl.int64)
    _, _, rot_lo, rot_hi = _norm_rotate_head(qkv_ptr + token * stride_qkv + head * HEAD_DIM,
                                             rope_ptr + row * stride_rope, q_norm_ptr, k_norm_ptr, is_q, ~is_q,
                                             eps, HEAD_DIM, True, BLOCK_HALF)
    out_lo = rot_lo.to(q_out_ptr.dtype.element_ty)
    out_hi = rot_hi.to(q_out_ptr.dtype.element_ty)

    pairs = tl.arange(0, BLOCK_HALF)
    # A q head stores into q, a k head into k: row limits; the other's address stays in bounds.
    q_dst = q_out_ptr + (token * num_q_heads + tl.where(is_q, head, 0)) * HEAD_DIM + pairs
    k_dst = k_out_ptr + (token * num_kv_heads + tl.where(is_q, 0, head - num_q_heads)) * HEAD_DIM + pairs
    q_rows = pairs < tl.where(is_q, HALF, 0)
    k_rows = pairs < tl.where(is_q, 0, HALF)
    tl.store(q_dst, out_lo, mask=q_rows)
    tl.store(q_dst + HALF, out_hi, mask=q_rows)
    tl.store(k_dst, out_lo, mask=k_rows)
    tl.store(k_dst + HALF, out_hi, mask=k_rows)


def qk_norm_rope(
    qkv: torch.Tensor,
    *,
    q_norm_weight: torch.Tensor,
    k_norm_weight: torch.Tensor,
    eps: float,
    rope_rows: torch.Tensor,
    rope_index: torch.Tensor,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3's per-head q/k RMSNorm and rotary for the T tokens of a step: qkv [T, (Hq + 2 Hkv) * D]
    (rows [q | k | v], the projection's output: contiguous heads, any row stride); token t rotates by
    rope_rows[rope_index[t]] (float32 [R, D] of [cos | sin] halves, RotaryEmbedding.rope_rows; the
    index is not range-checked). Returns new contiguous q [T, Hq, D] and k [T, Hkv, D], each head as
    `qk_norm_rope_cache` computes it; qkv is not changed (v stays where it is).

    One launch instead of two torch RMSNorms and the rotary formula (~25 launches a layer)."""
    if qkv.dtype not in _ACTIVATION_DTYPES:
        raise ValueError(f"qkv must be float32, float16 or bfloat16, got {qkv.dtype}")
    if head_dim < 2 or head_dim > 256 or head_dim & (head_dim - 1):
        raise ValueError(f"head_dim must be a power of two in [2, 256], got {head_dim}")
    if num_q_heads < 1 or num_kv_heads < 1:
        raise ValueError(f"need at least one q and one kv head, got {num_q_heads} / {num_kv_heads}")
    width = (num_q_heads + 2 * num_kv_heads) * head_dim
    if qkv.dim() != 2 or qkv.shape[1] != width or qkv.stride(-1) != 1:
        raise ValueError(f"qkv must be [T, {width}] ({num_q_heads} + 2 x {num_kv_heads} heads x {head_dim}) with a "
                         f"contiguous last axis, got {tuple(qkv.shape)} (strides {qkv.stride()})")
    tokens = qkv.shape[0]
    for name, w in (("q_norm_weight", q_norm_weight), ("k_norm_weight", k_norm_weight)):
        if w.shape != (head_dim,) or w.stride(0) != 1 or w.dtype not in _ACTIVATION_DTYPES:
            raise ValueError(f"{name} must be a contiguous float [{head_dim}], got {w.dtype} {tuple(w.shape)}")
    if rope_rows.dim() != 2 or rope_rows.shape[1] != head_dim or rope_rows.dtype != torch.float32 \
            or rope_rows.stride(-1) != 1:
        raise ValueError(f"rope_rows must be float32 [rows, {head_dim}] ([cos | sin]) with a contiguous last axis, "
                         f"got {rope_rows.dtype} {tuple(rope_rows.shape)}")
    if rope_index.shape != (tokens,) or rope_index.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"rope_index must be int32/int64 [{tokens}] (a row per token), got {rope_index.dtype} "
                         f"{tuple(rope_index.shape)}")
    for name, t in (("q_norm_weight", q_norm_weight), ("k_norm_weight", k_norm_weight), ("rope_rows", rope_rows),
                    ("rope_index", rope_index)):
        if t.device != qkv.device:
            raise ValueError(f"{name} is on {t.device}, qkv on {qkv.device}")
    q = torch.empty(tokens, num_q_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    k = torch.empty(tokens, num_kv_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    if tokens == 0:
        return q, k
    # num_warps as the one-token kernel: the same reduction over a head, so a token's q and k do
    # not depend on which of the two kernels ran it.
    _qk_norm_rope_kernel[(tokens, num_q_heads + num_kv_heads)](
        q, k, qkv, q_norm_weight, k_norm_weight, eps, rope_rows, rope_index, qkv.stride(0), rope_rows.stride(0),
        num_q_heads, num_kv_heads,
        HEAD_DIM=head_dim, BLOCK_HALF=triton.next_power_of_2(head_dim // 2), num_warps=1 if head_dim <= 128 else 2,
    )
    return q, k
