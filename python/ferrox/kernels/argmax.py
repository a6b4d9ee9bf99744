"""Greedy sampling's argmax over the vocabulary, in one launch split over the row.

torch's argmax reduces a [B, V] row with too few blocks at some vocabulary sizes: on an H200 one
row of Llama 3's 128,256 logits took 26 us (151,936: 8.4 us), on the critical path of every greedy
decode step (the next step's input id is this output). Here SPLIT programs per row each scan a
slice (per lane: the first largest value it sees), publish (max, first index), and the last one
to arrive (an arrival counter per row, left at zero for the next launch) picks the row's answer.

Semantics are torch's: the first index of the largest value; NaN counts as larger than anything
(as torch's argmax propagates it). SPLIT depends on V only, so one compiled variant serves every
batch size (no compile after the server's warm-up, whose greedy request alone compiles it). The
sampler uses it where it measured faster (layers/sampler.py `greedy`: a few rows of a large
vocabulary); torch's reduction handles many rows better (one row per program there would be slow).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ferrox.kernels.split_k import _Counters

_BLOCK = 1024
_COUNTERS = _Counters()  # its own: kernels on another stream never share a counter


@triton.jit(do_not_specialize=["V", "stride_x"])
def _argmax_rows_kernel(out_ptr, part_val_ptr, part_idx_ptr, count_ptr, x_ptr, V, stride_x, SPLIT: tl.constexpr,
                        SLICE: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    s = tl.program_id(1)
    base = x_ptr + row.to(tl.int64) * stride_x
    lanes = s * SLICE + tl.arange(0, BLOCK)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_i = lanes  # a lane that never sees a larger value keeps its first column (ties: earliest)
    for k0 in range(0, SLICE, BLOCK):
        cols = lanes + k0
        v = tl.load(base + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
        v = tl.where(v != v, float("inf"), v)  # NaN wins, as in torch
        take = v > best  # strict: a lane keeps the first of equal values
        best = tl.where(take, v, best)
        best_i = tl.where(take, cols, best_i)
    m = tl.max(best, axis=0)
    i = tl.min(tl.where(best == m, best_i, V), axis=0)
    part = row * SPLIT + s
    tl.store(part_val_ptr + part, m)
    tl.store(part_idx_ptr + part, i)
    # Partials written by every thread before the count (release); read by the last after it (acquire).
    tl.debug_barrier()
    arrived = tl.atomic_add(count_ptr + row, 1, sem="acq_rel", scope="gpu")
    if arrived == SPLIT - 1:
        parts = row * SPLIT + tl.arange(0, SPLIT)
        vals = tl.load(part_val_ptr + parts, cache_modifier=".cg")
        idx = tl.load(part_idx_ptr + parts, cache_modifier=".cg")
        top = tl.max(vals, axis=0)
        tl.store(out_ptr + row, tl.min(tl.where(vals == top, idx, V), axis=0).to(tl.int64))
        tl.store(count_ptr + row, 0)


def split_for_vocab(vocab: int) -> int:
    """Programs per row: a power of two, ~4K logits each, at most 32 (a batch-1 row of a 128k
    vocabulary then spreads over 32 SMs)."""
    split = 1
    while split < 32 and split * 2 * 4 * _BLOCK <= vocab:
        split *= 2
    return split


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """The first index of each row's largest value: [B, V] (contiguous rows) -> [B] int64."""
    if logits.dim() != 2 or logits.stride(-1) != 1:
        raise ValueError(f"argmax_rows: logits must be [B, V] with a contiguous last axis, got "
                         f"{tuple(logits.shape)} (strides {logits.stride()})")
    rows, vocab = logits.shape
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if vocab == 0:
        return logits.argmax(dim=-1)  # torch's error for an empty row
    if rows == 0:
        return out
    split = split_for_vocab(vocab)
    slice_len = triton.cdiv(triton.cdiv(vocab, split), _BLOCK) * _BLOCK
    part_val = torch.empty(rows * split, dtype=torch.float32, device=logits.device)
    part_idx = torch.empty(rows * split, dtype=torch.int32, device=logits.device)
    _argmax_rows_kernel[(rows, split)](out, part_val, part_idx, _COUNTERS.get(logits.device, rows), logits, vocab,
                                       logits.stride(0), SPLIT=split, SLICE=slice_len, BLOCK=_BLOCK, num_warps=4)
    return out
