"""Whole KV blocks copied between two caches by index, one launch per layer: the host tier's offloads
(a device block -> a host slot) and loads (a host slot -> a device block), worker/host_kv_tier.py.

One side lives in pinned host memory, which unified addressing maps into the device's address space, so
the program reads or writes it over the bus itself (the same mapping kernels/host_flag.py polls). Why
not the copy engines: a step's blocks are scattered on both sides, and a copy engine moves one
contiguous range a call, so either thousands of small copies (a block of one layer is 32 KB on an 8B
model: 256 blocks x 32 layers x 2 planes a 4k-token prompt) or a gather into a staging buffer on the
host's side, a memcpy by the CPU of every byte (what the first version did: slower than recomputing
the prompt). Here the gather and the transfer are one pass, queued on the stream like any kernel: no
host thread waits, and a later step's reads of a slot are ordered after the write by the stream.

Both caches are [planes, blocks or slots, ...] with the same trailing shape; rows are copied as 32-bit
words (any cache dtype, FP8 included, is reinterpreted), each program a chunk of one block of one plane.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_CHUNK_WORDS = 2048  # 8 KB a program: 16 words a thread at 4 warps, 4 16-byte accesses each


@triton.jit
def _copy_blocks_kernel(src, dst, src_index, dst_index, src_plane_stride, dst_plane_stride,
                        ROW: tl.constexpr, CHUNK: tl.constexpr):
    pair = tl.program_id(0)
    plane = tl.program_id(1)
    chunk = tl.program_id(2)
    s = tl.load(src_index + pair).to(tl.int64)
    d = tl.load(dst_index + pair).to(tl.int64)
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    mask = offs < ROW
    values = tl.load(src + plane.to(tl.int64) * src_plane_stride + s * ROW + offs, mask=mask)
    tl.store(dst + plane.to(tl.int64) * dst_plane_stride + d * ROW + offs, values, mask=mask)


def _as_rows(cache: torch.Tensor) -> torch.Tensor:
    """[planes, n, ...] -> [planes, n, words] of int32 (or bytes where a row is not whole words)."""
    if not cache.is_contiguous():
        raise ValueError(f"block copies need contiguous caches, got strides {cache.stride()}")
    flat = cache.view(cache.shape[0], cache.shape[1], -1).view(torch.uint8)
    return flat.view(torch.int32) if flat.shape[-1] % 4 == 0 else flat


def copy_blocks(src: torch.Tensor, dst: torch.Tensor, src_index: torch.Tensor, dst_index: torch.Tensor) -> None:
    """dst[:, dst_index[i]] = src[:, src_index[i]] for every i, queued on the current stream. The indices are
    int64 tensors on the device that runs the copy (the one holding the device-side cache)."""
    if src.shape[0] != dst.shape[0] or src.shape[2:] != dst.shape[2:] or src.dtype != dst.dtype:
        raise ValueError(f"block copies between unlike caches: {tuple(src.shape)} {src.dtype} -> "
                         f"{tuple(dst.shape)} {dst.dtype}")
    pairs = src_index.numel()
    if pairs != dst_index.numel():
        raise ValueError(f"{pairs} source blocks for {dst_index.numel()} destinations")
    if pairs == 0:
        return
    s, d = _as_rows(src), _as_rows(dst)
    row = s.shape[-1]
    grid = (pairs, s.shape[0], triton.cdiv(row, _CHUNK_WORDS))
    _copy_blocks_kernel[grid](s, d, src_index, dst_index, s.stride(0), d.stride(0), ROW=row,
                              CHUNK=_CHUNK_WORDS, num_warps=4)
