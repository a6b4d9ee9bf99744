"""Write this step's K/V into the paged KV cache through the slot mapping.

Layout (see ferrox.attention.metadata): kv_cache[2, num_blocks, block_size, num_kv_heads, head_dim].
Token t goes to block `slot // block_size`, offset `slot % block_size`. Slot -1 marks a padding
token (CUDA-graph padding, or a token whose KV must not be stored): it is skipped, so padding never
overwrites a live block.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr,
    value_ptr,
    cache_ptr,
    slot_mapping_ptr,
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
    tl.store(dst, k.to(cache_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + stride_ckv, v.to(cache_ptr.dtype.element_ty), mask=mask)


def reshape_and_cache(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store key/value [num_tokens, num_kv_heads, head_dim] at slot_mapping[num_tokens] (in place).

    Rows of key/value beyond slot_mapping's length are ignored; the head_dim axis must be contiguous.
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
    if num_tokens == 0:
        return
    _reshape_and_cache_kernel[(num_tokens,)](
        key,
        value,
        kv_cache,
        slot_mapping,
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
