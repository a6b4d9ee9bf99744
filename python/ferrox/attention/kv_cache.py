"""Allocation of the paged KV cache: one tensor per layer in the layout of metadata.py."""

from __future__ import annotations

import torch

from ferrox.model_spec import ModelSpec


def kv_cache_shape(spec: ModelSpec, num_blocks: int, block_size: int) -> tuple[int, ...]:
    return (2, num_blocks, block_size, spec.num_kv_heads, spec.head_dim)


def kv_cache_bytes_per_block(spec: ModelSpec, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block costs across ALL layers (K and V): divide free memory by this for num_blocks."""
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * block_size * spec.num_kv_heads * spec.head_dim * elem * spec.num_layers


def allocate_kv_caches(
    spec: ModelSpec, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device | str
) -> list[torch.Tensor]:
    """Zero-filled, so that padded positions a backend gathers (and masks) never hold NaN/Inf:
    a masked score gets weight 0, but 0 * NaN would still poison the output."""
    if num_blocks < 1 or block_size < 1:
        raise ValueError(f"num_blocks ({num_blocks}) and block_size ({block_size}) must be >= 1")
    shape = kv_cache_shape(spec, num_blocks, block_size)
    return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(spec.num_layers)]
