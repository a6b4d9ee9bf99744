"""Rotary position embedding, neox layout (the two halves of the rotated dims pair up), in place.

The caller builds cos_sin_cache [max_position, rot_dim] = [cos | sin] (each rot_dim / 2 wide),
including any frequency scaling (Llama 3.1's piecewise rescale), once at load time; the kernel
only gathers a row per position and rotates q and k of that token together in one program.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate(x_ptr, token, stride_t, stride_h, num_heads, cos, sin, HEADS_PAD: tl.constexpr, HALF_PAD: tl.constexpr, half):
    heads = tl.arange(0, HEADS_PAD)[:, None]
    dims = tl.arange(0, HALF_PAD)[None, :]
    mask = (heads < num_heads) & (dims < half)
    ptr = x_ptr + token * stride_t + heads * stride_h + dims
    x1 = tl.load(ptr, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(ptr + half, mask=mask, other=0.0).to(tl.float32)
    tl.store(ptr, (x1 * cos - x2 * sin).to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(ptr + half, (x2 * cos + x1 * sin).to(x_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_neox_kernel(
    q_ptr,
    k_ptr,
    positions_ptr,
    cache_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_cache,
    num_q_heads,
    num_kv_heads,
    half,
    Q_HEADS_PAD: tl.constexpr,
    KV_HEADS_PAD: tl.constexpr,
    HALF_PAD: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + token)
    dims = tl.arange(0, HALF_PAD)[None, :]
    row = cache_ptr + pos * stride_cache
    cos = tl.load(row + dims, mask=dims < half, other=1.0).to(tl.float32)
    sin = tl.load(row + half + dims, mask=dims < half, other=0.0).to(tl.float32)
    _rotate(q_ptr, token, stride_qt, stride_qh, num_q_heads, cos, sin, Q_HEADS_PAD, HALF_PAD, half)
    _rotate(k_ptr, token, stride_kt, stride_kh, num_kv_heads, cos, sin, KV_HEADS_PAD, HALF_PAD, half)


def rotary_neox_(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor) -> None:
    """Rotate q [T, Hq, D] and k [T, Hkv, D] in place at positions [T] (first rot_dim dims of each head)."""
    if q.dim() != 3 or k.dim() != 3 or q.shape[0] != k.shape[0] or positions.shape[0] != q.shape[0]:
        raise ValueError(
            f"rotary needs q [T, Hq, D], k [T, Hkv, D], positions [T], got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(positions.shape)}"
        )
    rot_dim = cos_sin_cache.shape[1]
    if rot_dim % 2 or rot_dim > q.shape[2] or q.shape[2] != k.shape[2]:
        raise ValueError(f"cos_sin_cache width {rot_dim} must be even and <= head_dim {q.shape[2]}")
    if q.stride(-1) != 1 or k.stride(-1) != 1 or cos_sin_cache.stride(-1) != 1:
        raise ValueError("rotary needs a contiguous head_dim axis")
    if q.shape[0] == 0:
        return
    half = rot_dim // 2
    _rotary_neox_kernel[(q.shape[0],)](
        q,
        k,
        positions,
        cos_sin_cache,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        cos_sin_cache.stride(0),
        q.shape[1],
        k.shape[1],
        half,
        Q_HEADS_PAD=triton.next_power_of_2(q.shape[1]),
        KV_HEADS_PAD=triton.next_power_of_2(k.shape[1]),
        HALF_PAD=triton.next_power_of_2(half),
        num_warps=4,
    )


def rope_inv_freq(rot_dim: int, base: float, rope_scaling: dict | None = None) -> torch.Tensor:
    """float64 [rot_dim / 2] inverse frequencies, with optional Llama 3.1 scaling.

    rope_scaling {"rope_type": "llama3", "factor", "low_freq_factor", "high_freq_factor",
    "original_max_position_embeddings"}: wavelengths longer than original/low_freq_factor are
    divided by `factor`, shorter than original/high_freq_factor kept, and the band between
    interpolated smoothly (the published Llama 3.1 recipe)."""
    inv_freq = 1.0 / (base ** (torch.arange(0, rot_dim, 2, dtype=torch.float64) / rot_dim))
    if rope_scaling is None:
        return inv_freq
    kind = rope_scaling.get("rope_type", rope_scaling.get("type"))
    if kind != "llama3":
        raise ValueError(f"rope_scaling type {kind!r} is not supported here (only 'llama3')")
    factor = float(rope_scaling["factor"])
    low, high = float(rope_scaling["low_freq_factor"]), float(rope_scaling["high_freq_factor"])
    original = float(rope_scaling["original_max_position_embeddings"])
    wavelen = 2 * torch.pi / inv_freq
    smooth = (original / wavelen - low) / (high - low)
    interpolated = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    return torch.where(
        wavelen > original / low, inv_freq / factor, torch.where(wavelen < original / high, inv_freq, interpolated)
    )


def neox_cos_sin_cache(
    rot_dim: int,
    max_position: int,
    base: float,
    rope_scaling: dict | None = None,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """[max_position, rot_dim] = [cos | sin] for rotary_neox_ (angles in float64, then cast)."""
    inv_freq = rope_inv_freq(rot_dim, base, rope_scaling)
    angles = torch.outer(torch.arange(max_position, dtype=torch.float64), inv_freq)
    return torch.cat([angles.cos(), angles.sin()], dim=-1).to(dtype=dtype, device=device)
