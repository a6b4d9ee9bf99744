"""A grammar's allow-bits applied to the logits in one launch: disallowed tokens set to -inf in
place. Layout (llguidance's): int32 words, bit j of word w allows token 32 w + j.

The mask arrives for the constrained rows only (its rows name the logits rows they belong to),
so a batch with a few constrained requests uploads and touches only those rows, and the logits
are never read: each program stores -inf where its block's bits are clear. (The torch path,
structured/bitmask.py's unpack + masked_fill + index_copy, is 6-8 launches and three passes over
the rows; it stays the CPU path.)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _apply_token_bitmask_kernel(logits_ptr, mask_ptr, rows_ptr, vocab, words, stride_l, BLOCK: tl.constexpr):
    i = tl.program_id(0)
    row = tl.load(rows_ptr + i)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < vocab
    w = tl.load(mask_ptr + i * words + offs // 32, mask=inside, other=-1)  # (one word serves 32 lanes, from L1)
    allowed = (w >> (offs % 32)) & 1
    ninf = tl.full([BLOCK], float("-inf"), logits_ptr.dtype.element_ty)
    tl.store(logits_ptr + row.to(tl.int64) * stride_l + offs, ninf, mask=inside & (allowed == 0))


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """logits [num_rows, V] float (rows contiguous); bitmask int32 [R, >= ceil(V / 32)], row i the
    allow-bits of logits row rows[i] (int64 [R]); all on one device."""
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(f"logits must be [rows, vocab] with contiguous rows, got {tuple(logits.shape)}")
    vocab = logits.shape[1]
    if bitmask.dim() != 2 or bitmask.dtype != torch.int32 or bitmask.shape[1] * 32 < vocab \
            or not bitmask.is_contiguous():
        raise ValueError(f"bitmask must be contiguous int32 [R, >= {(vocab + 31) // 32}], got "
                         f"{bitmask.dtype} {tuple(bitmask.shape)}")
    if rows.shape != (bitmask.shape[0],) or rows.dtype != torch.int64:
        raise ValueError(f"rows must be int64 [{bitmask.shape[0]}], got {rows.dtype} {tuple(rows.shape)}")
    if not rows.numel():
        return
    block = 4096
    _apply_token_bitmask_kernel[(rows.numel(), triton.cdiv(vocab, block))](
        logits, bitmask, rows, vocab, bitmask.shape[1], logits.stride(0), BLOCK=block, num_warps=4)
