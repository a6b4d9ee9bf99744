"""The FP8 KV cache's element type and default scales, as the kernels read them (below attention/,
which owns the cache and its per-layer scales: attention/kv_cache.py)."""

from __future__ import annotations

from functools import lru_cache

import torch

FP8_KV_DTYPE = torch.float8_e4m3fn
FP8_KV_MAX = 448.0  # largest finite float8_e4m3fn


def is_fp8_kv_cache(kv_cache: torch.Tensor) -> bool:
    return kv_cache.dtype == FP8_KV_DTYPE


@lru_cache(maxsize=16)
def unit_kv_scales(device: torch.device) -> torch.Tensor:
    """float32 [1.0, 1.0] on `device`: the scales of a kernel call that passes none."""
    return torch.ones(2, dtype=torch.float32, device=device)
