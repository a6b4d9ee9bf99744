"""Split-K for the one-token tensor-core products (w8a8_dot_gemv.py): a narrow
projection (o_proj, down: N = 4096 on an 8B model) has too few row blocks to fill an H200's 132
SMs, so program (n, s) streams rows n over the s-th K range and the last program of each row block
to arrive finishes the sum and runs the epilogue.

The arrival counters (one int32 per row block) are left at zero by the last program, so they live
in one persistent buffer per device and CUDA-graph replays need no memset.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl


@triton.jit
def _merge_split_k(part_ptr, count_ptr, y, up, rows, rmask, n_out, pid_n, pid_k, SPLIT: tl.constexpr,
                   SILU_MUL: tl.constexpr):
    """Publish this program's partial row sums y (and up, with SILU_MUL) to part [SPLIT, 2, n_out]
    and count its arrival. Returns (last, y, up): for the last program of row block pid_n, the sums
    over every K range (and the counter is reset); for the others, last is False."""
    tl.store(part_ptr + (pid_k * 2) * n_out + rows, y, mask=rmask)
    if SILU_MUL:
        tl.store(part_ptr + (pid_k * 2 + 1) * n_out + rows, up, mask=rmask)
    # Every thread's partials are written before the count is raised (release); the last program
    # reads the others' through L2 (.cg) after the count (acquire).
    tl.debug_barrier()
    arrived = tl.atomic_add(count_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
    last = arrived == SPLIT - 1
    if last:
        y = tl.zeros_like(y)
        up = tl.zeros_like(up)
        for s in range(SPLIT):
            y += tl.load(part_ptr + (s * 2) * n_out + rows, mask=rmask, other=0.0, cache_modifier=".cg")
            if SILU_MUL:
                up += tl.load(part_ptr + (s * 2 + 1) * n_out + rows, mask=rmask, other=0.0, cache_modifier=".cg")
        tl.store(count_ptr + pid_n, 0)  # ready for the next launch
    return last, y, up


class _Counters:
    """One zeroed int32 buffer per device for the arrival counts (each launch leaves them at zero).
    Grown, never shrunk; never reallocated while a CUDA graph may hold it, because the size needed
    is fixed per model and reached during warm-up."""

    def __init__(self) -> None:
        self._by_device: dict[torch.device, torch.Tensor] = {}

    def get(self, device: torch.device, size: int) -> torch.Tensor:
        buf = self._by_device.get(device)
        if buf is None or buf.numel() < size:
            buf = torch.zeros(max(size, 1024), dtype=torch.int32, device=device)
            self._by_device[device] = buf
        return buf


_COUNTERS = _Counters()


def split_buffers(split: int, blocks: int, n_out: int, out: torch.Tensor,
                  dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """(partial sums [split, 2, n_out] in dtype -- the accumulators', float32 or int32 --, arrival
    counters) for a launch with `blocks` row blocks; with split 1 neither is read and `out` stands
    in for both."""
    if split == 1:
        return out, out
    part = torch.empty(split, 2, n_out, dtype=dtype, device=out.device)
    return part, _COUNTERS.get(out.device, blocks)


def split_for(blocks: int, k: int, num_sms: int, *, min_range: int) -> int:
    """K ranges per row block: doubled until about two programs run per SM, each range kept at
    least `min_range` wide."""
    split = 1
    while blocks * split < 2 * num_sms and k // (split * 2) >= min_range:
        split *= 2
    return split


@functools.cache
def num_sms(device: torch.device) -> int:
    """(Cached: eager one-token steps ask once per projection.)"""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # the interpreter: any count exercises the split
