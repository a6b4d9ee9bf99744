"""Write this step's K/V into the paged KV cache through the slot mapping.

Layout (see ferrox.attention.metadata): kv_cache[2, num_blocks, block_size, num_kv_heads, head_dim].
Token t goes to block `slot // block_size`, offset `slot % block_size`. Slot -1 marks a padding
token (CUDA-graph padding, or a token whose KV must not be stored): it is skipped, so padding never
overwrites a live block.

An FP8 cache (float8_e4m3fn, attention/kv_cache.py) stores k / k_scale and v / v_scale, saturated at
+-448, with the layer's float32 (k_scale, v_scale) read by pointer (so CUDA graphs replay the
loaded values). The division is IEEE round-to-nearest, as torch's, so the Triton and torch writers
store the same bytes.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ferrox.kernels.kv_fp8 import unit_kv_scales

# The Triton interpreter (CPU tests) converts float -> fp8 without carrying a rounded-up mantissa
# into the exponent (0.1249 becomes 0.0625, not 0.125). There the value is first rounded to the
# E4M3 grid in float32, so its cast is exact; compiled kernels convert in hardware (round to
# nearest even), which needs no help.
_INTERPRETED = tl.constexpr(os.environ.get("TRITON_INTERPRET") == "1")


@triton.jit
def quantize_kv_fp8(x, scale):
    """fp8(clamp(x / scale, -448, 448)): the FP8 cache's write rule (attention/kv_cache.py), for
    x of any float dtype and a float32 scale; the division rounds as torch's does."""
    y = tl.clamp(tl.div_rn(x.to(tl.float32), scale), -448.0, 448.0)
    if _INTERPRETED:
        # Round to a multiple of the E4M3 ulp at y's exponent (2^-9 below the normal range) by
        # adding and removing 1.5 * 2^23 ulps: float32 addition rounds to nearest even there. The
        # sign is put back, so that what rounds to zero stays -0.0 when negative (as in hardware).
        bits = y.to(tl.int32, bitcast=True)
        exponent = tl.maximum(((bits >> 23) & 0xFF) - 127, -6)
        magic = (((exponent + 147) << 23) | (1 << 22)).to(tl.float32, bitcast=True)
        rounded = ((y + magic) - magic).to(tl.int32, bitcast=True)
        y = (rounded | (bits & -2147483648)).to(tl.float32, bitcast=True)
    return y.to(tl.float8e4nv, fp_downcast_rounding="rtne")


@triton.jit
def store_head_kv(cache_ptr, kv_scale_ptr, slot_ptr, head, pairs, lo, hi, num_q_heads, num_kv_heads, block_size,
                  stride_ckv, stride_cblock, stride_cslot, stride_chead, HALF: tl.constexpr):
    """The one-token kernels' KV write (gemv.py's qkv kernel, qk_norm_rope.py): a program holding
    rotary pairs `pairs` of head `head` of [q | k | v] heads, as halves lo (d) and hi (d + HALF),
    stores k and v heads into the cache at the token's slot (slot_ptr[0]; -1: nothing); q heads
    store nothing here."""
    is_kv = head >= num_q_heads
    is_v = head >= num_q_heads + num_kv_heads
    slot = tl.load(slot_ptr).to(tl.int64)
    # Scalar conditions become lane limits (a block mask must come from a block comparison).
    kv_mask = pairs < tl.where(is_kv & (slot >= 0), HALF, 0)
    plane = is_v.to(tl.int64)
    kv_head = head - num_q_heads - plane * num_kv_heads
    safe_slot = tl.maximum(slot, 0)
    dst = (cache_ptr + plane * stride_ckv + (safe_slot // block_size) * stride_cblock
           + (safe_slot % block_size) * stride_cslot + kv_head * stride_chead + pairs)
    if cache_ptr.dtype.element_ty == tl.float8e4nv:
        kv_scale = tl.load(kv_scale_ptr + plane)
        lo, hi = quantize_kv_fp8(lo, kv_scale), quantize_kv_fp8(hi, kv_scale)
    tl.store(dst, lo.to(cache_ptr.dtype.element_ty), mask=kv_mask)
    tl.store(dst + HALF, hi.to(cache_ptr.dtype.element_ty), mask=kv_mask)


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr,
    value_ptr,
    cache_ptr,
    slot_mapping_ptr,
    kv_scale_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ckv,  # K plane -> V plane
    stride_cblock,
    stride_cslot,
    stride_chead,
    num_kv_heads,
    head_dim,
    block_size,
    HEADS_PAD: tl.constexpr,
    DIM_PAD: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token)
    if slot < 0:
        return
    block = slot // block_size
    offset = slot % block_size

    heads = tl.arange(0, HEADS_PAD)[:, None]
    dims = tl.arange(0, DIM_PAD)[None, :]
    mask = (heads < num_kv_heads) & (dims < head_dim)

    k = tl.load(key_ptr + token * stride_kt + heads * stride_kh + dims, mask=mask)
    v = tl.load(value_ptr + token * stride_vt + heads * stride_vh + dims, mask=mask)
    dst = cache_ptr + block.to(tl.int64) * stride_cblock + offset * stride_cslot + heads * stride_chead + dims
    if cache_ptr.dtype.element_ty == tl.float8e4nv:
        k = quantize_kv_fp8(k, tl.load(kv_scale_ptr))
        v = quantize_kv_fp8(v, tl.load(kv_scale_ptr + 1))
    tl.store(dst, k.to(cache_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + stride_ckv, v.to(cache_ptr.dtype.element_ty), mask=mask)


def reshape_and_cache(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
    kv_scale: torch.Tensor | None = None,
) -> None:
    """Store key/value [num_tokens, num_kv_heads, head_dim] at slot_mapping[num_tokens] (in place).

    Rows of key/value beyond slot_mapping's length are ignored; the head_dim axis must be contiguous.
    kv_scale: float32 (k_scale, v_scale) on the cache's device, read by an FP8 cache (None: 1.0).
    """
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2:
        raise ValueError(f"kv_cache must be [2, num_blocks, block_size, num_kv_heads, head_dim], got {tuple(kv_cache.shape)}")
    num_tokens = slot_mapping.shape[0]
    _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    if key.shape[1:] != (num_kv_heads, head_dim) or value.shape[1:] != (num_kv_heads, head_dim):
        raise ValueError(
            f"key/value must be [tokens, {num_kv_heads}, {head_dim}], got {tuple(key.shape)} / {tuple(value.shape)}"
        )
    if key.stride(-1) != 1 or value.stride(-1) != 1 or kv_cache.stride(-1) != 1:
        raise ValueError("key, value and kv_cache need a contiguous head_dim axis")
    if kv_scale is not None and (kv_scale.dtype != torch.float32 or kv_scale.numel() != 2):
        raise ValueError(f"kv_scale must be float32 (k_scale, v_scale), got {kv_scale.dtype} {tuple(kv_scale.shape)}")
    if num_tokens == 0:
        return
    _reshape_and_cache_kernel[(num_tokens,)](
        key,
        value,
        kv_cache,
        slot_mapping,
        kv_scale if kv_scale is not None else unit_kv_scales(kv_cache.device),
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        kv_cache.stride(3),
        num_kv_heads,
        head_dim,
        block_size,
        HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        DIM_PAD=triton.next_power_of_2(head_dim),
    )
