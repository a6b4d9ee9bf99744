"""Qwen3's per-head q/k RMSNorm, rotary and the KV-cache write of one decode token, in one launch.

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
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ferrox.kernels.kv_fp8 import unit_kv_scales
from ferrox.kernels.pdl import pdl_launch, pdl_launch_dependents, pdl_wait
from ferrox.kernels.reshape_and_cache import store_head_kv


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
    pdl_launch_dependents(USE_PDL)
    pdl_wait(USE_PDL)
    head = tl.program_id(0)
    pairs = tl.arange(0, BLOCK_HALF)
    lanes = pairs < HALF
    src = qkv_ptr + head * HEAD_DIM + pairs
    lo = tl.load(src, mask=lanes, other=0.0).to(tl.float32)
    hi = tl.load(src + HALF, mask=lanes, other=0.0).to(tl.float32)

    is_q = head < num_q_heads
    is_kv = head >= num_q_heads
    is_v = head >= num_q_heads + num_kv_heads
    n_lo, n_hi = lo, hi
    if QK_NORM:
        # Each head reads only its own norm weight (none for v): row limits, as below.
        w_lo = (tl.load(q_norm_ptr + pairs, mask=pairs < tl.where(is_q, HALF, 0), other=0.0).to(tl.float32)
                + tl.load(k_norm_ptr + pairs, mask=pairs < tl.where(is_kv & ~is_v, HALF, 0),
                          other=0.0).to(tl.float32))
        w_hi = (tl.load(q_norm_ptr + HALF + pairs, mask=pairs < tl.where(is_q, HALF, 0), other=0.0).to(tl.float32)
                + tl.load(k_norm_ptr + HALF + pairs, mask=pairs < tl.where(is_kv & ~is_v, HALF, 0),
                          other=0.0).to(tl.float32))
        rstd = tl.rsqrt((tl.sum(lo * lo, axis=0) + tl.sum(hi * hi, axis=0)) / HEAD_DIM + eps)
        # RMSNorm's roundings: the normed head to the activation dtype, then times the weight, rounded.
        n_lo = (lo * rstd).to(qkv_ptr.dtype.element_ty).to(tl.float32)
        n_hi = (hi * rstd).to(qkv_ptr.dtype.element_ty).to(tl.float32)
        n_lo = (w_lo * n_lo).to(qkv_ptr.dtype.element_ty).to(tl.float32)
        n_hi = (w_hi * n_hi).to(qkv_ptr.dtype.element_ty).to(tl.float32)

    cos = tl.load(rope_ptr + pairs, mask=lanes, other=1.0)
    sin = tl.load(rope_ptr + HALF + pairs, mask=lanes, other=0.0)
    # v is neither normed nor rotated: selected, not multiplied by (cos, sin) = (1, 0), so an inf
    # in v stays an inf.
    out_lo = tl.where(is_v, lo, n_lo * cos - n_hi * sin).to(q_out_ptr.dtype.element_ty)
    out_hi = tl.where(is_v, hi, n_hi * cos + n_lo * sin).to(q_out_ptr.dtype.element_ty)

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
