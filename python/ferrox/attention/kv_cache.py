"""Allocation of the paged KV cache: one tensor per layer in the layout of metadata.py.

Under tensor parallelism (tp_size > 1) each rank caches only the KV heads its query heads read
(distributed/sharding.kv_head_range), so a block costs each rank 1/N of the bytes (or one head's
worth when ranks outnumber KV heads).
"""

from __future__ import annotations

import torch

from ferrox.distributed.sharding import local_num_kv_heads
from ferrox.model_spec import ModelSpec


def kv_cache_shape(spec: ModelSpec, num_blocks: int, block_size: int, tp_size: int = 1) -> tuple[int, ...]:
    return (2, num_blocks, block_size, local_num_kv_heads(spec, tp_size), spec.head_dim)


def kv_cache_bytes_per_block(spec: ModelSpec, block_size: int, dtype: torch.dtype, tp_size: int = 1) -> int:
    """Bytes one block costs across ALL layers (K and V) on one rank: divide free memory by this."""
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * block_size * local_num_kv_heads(spec, tp_size) * spec.head_dim * elem * spec.num_layers


def allocate_kv_caches(
    spec: ModelSpec, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device | str,
    tp_size: int = 1,
) -> list[torch.Tensor]:
    """Zero-filled, so that padded positions a backend gathers (and masks) never hold NaN/Inf:
    a masked score gets weight 0, but 0 * NaN would still poison the output."""
    if num_blocks < 1 or block_size < 1:
        raise ValueError(f"num_blocks ({num_blocks}) and block_size ({block_size}) must be >= 1")
    shape = kv_cache_shape(spec, num_blocks, block_size, tp_size)
    return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(spec.num_layers)]
