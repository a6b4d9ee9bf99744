"""The grouped MoE path's sort of (token, slot) pairs by expert, in three launches.

fused_moe.py's grouped kernels read the T*k pairs grouped by expert, each expert's run padded to
a multiple of BLOCK_M rows so a BLOCK_M-row block belongs to one expert (`ExpertBlocks`). Built
from torch ops (a histogram by scatter_add, two cumsums, a stable sort, searchsorted, ...) that
was ~29 launches per sparse layer: an eager prefill of a short prompt on Qwen3-30B-A3B issued
3,339 device ops and waited on the host (64 ms to the first token, 11 ms of GPU work), and each
decode graph of 16-512 tokens replayed those ~25 tiny kernels in all 48 layers.

Here the pairs are cut into chunks of CHUNK:
1. `_chunk_counts_kernel` (a program per chunk): each chunk's histogram over the experts.
2. `_expert_offsets_kernel` (one program): the experts' totals, their padded starts, each block's
   expert and the rows in use; every row set to the pad id; and, per chunk and expert, the offset
   that turns a pair's position in its chunk's sorted order into its row (written over the
   chunk's histogram).
3. `_place_pairs_kernel` (a program per chunk): sorts its chunk by (expert, position) and writes
   each pair id to its row.

The order inside an expert is the pairs' order (stable), as a sort would give, and nothing depends
on timing (no atomics), so the layout is the same every run. Histogram bins: NB = the next power of
two above E; masked lanes count in bin NB - 1, which no expert uses.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Pairs per chunk: one tl.sort of this many keys per program (a few us); kernel 2 loops over the
# chunks, ~256 of them at an 8192-token step of top-8 routing.
CHUNK = 256


@triton.jit
def _expert_bins(ids_ptr, i, num_pairs, num_experts, NB: tl.constexpr):
    """The histogram bins of pairs i: their experts; lanes past the pairs (and any id outside
    [0, E), which the router never gives) in bin NB - 1, which is no expert's and is not placed."""
    experts = tl.load(ids_ptr + i, mask=i < num_pairs, other=NB - 1).to(tl.int32)
    return tl.where((experts >= 0) & (experts < num_experts), experts, NB - 1)


@triton.jit(do_not_specialize=["num_pairs"])
def _chunk_counts_kernel(ids_ptr, counts_ptr, num_pairs, num_experts, NB: tl.constexpr, CHUNK: tl.constexpr):
    c = tl.program_id(0)
    i = c * CHUNK + tl.arange(0, CHUNK)
    experts = _expert_bins(ids_ptr, i, num_pairs, num_experts, NB)
    tl.store(counts_ptr + c * NB + tl.arange(0, NB), tl.histogram(experts, NB))


@triton.jit(do_not_specialize=["num_pairs", "num_chunks", "max_rows"])
def _expert_offsets_kernel(counts_ptr, pair_ids_ptr, block_expert_ptr, num_rows_ptr, num_pairs, num_chunks,
                           num_experts, max_rows, NB: tl.constexpr, BLOCK_M: tl.constexpr,
                           BLOCK_ROWS: tl.constexpr, BLOCK_B: tl.constexpr):
    bins = tl.arange(0, NB)
    is_expert = bins < num_experts
    total = tl.zeros([NB], dtype=tl.int32)
    for c in range(num_chunks):
        total += tl.load(counts_ptr + c * NB + bins)
    padded = tl.where(is_expert, (total + BLOCK_M - 1) // BLOCK_M * BLOCK_M, 0)
    end = tl.cumsum(padded, axis=0)
    start = end - padded
    num_rows = tl.sum(padded, axis=0)
    tl.store(num_rows_ptr, num_rows.to(tl.int64))

    # Chunk c's pairs of expert e sit at sorted positions first[e] .. first[e] + count - 1 of the
    # chunk and belong at rows start[e] + (e's pairs in earlier chunks) + (position - first[e]).
    before = tl.zeros([NB], dtype=tl.int32)
    for c in range(num_chunks):
        count = tl.load(counts_ptr + c * NB + bins)
        first = tl.cumsum(count, axis=0) - count
        tl.store(counts_ptr + c * NB + bins, start + before - first)
        before += count

    # Every row starts as padding (the sentinel pair id); kernel 3 overwrites the real ones.
    for r0 in range(0, max_rows, BLOCK_ROWS):
        rows = r0 + tl.arange(0, BLOCK_ROWS)
        tl.store(pair_ids_ptr + rows, tl.full([BLOCK_ROWS], 0, tl.int32) + num_pairs, mask=rows < max_rows)

    # Block b's expert: the first one whose padded run ends past the block's first row (empty
    # experts end where the previous one does, so they own no block); -1 past the rows in use.
    for b0 in range(0, max_rows // BLOCK_M, BLOCK_B):
        blocks = b0 + tl.arange(0, BLOCK_B)
        first_row = blocks * BLOCK_M
        owner = tl.sum(((end[None, :] <= first_row[:, None]) & is_expert[None, :]).to(tl.int32), axis=1)
        tl.store(block_expert_ptr + blocks, tl.where(first_row < num_rows, owner, -1),
                 mask=blocks < max_rows // BLOCK_M)


@triton.jit(do_not_specialize=["num_pairs"])
def _place_pairs_kernel(ids_ptr, offsets_ptr, pair_ids_ptr, num_pairs, num_experts, NB: tl.constexpr,
                        CHUNK: tl.constexpr):
    c = tl.program_id(0)
    local = tl.arange(0, CHUNK)
    i = c * CHUNK + local
    experts = _expert_bins(ids_ptr, i, num_pairs, num_experts, NB)
    # Sorting (expert, position) keeps the chunk's order inside each expert.
    keys = tl.sort(experts * CHUNK + local)
    sorted_experts = keys // CHUNK
    pair = c * CHUNK + keys % CHUNK
    real = sorted_experts < num_experts
    offset = tl.load(offsets_ptr + c * NB + sorted_experts, mask=real, other=0)
    tl.store(pair_ids_ptr + offset + local, pair, mask=real)


def max_aligned_rows(num_pairs: int, num_experts: int, block_m: int) -> int:
    """An upper bound on the padded rows, from shapes only (no host sync): at most min(E, pairs)
    experts are non-empty, each wasting under block_m rows."""
    return triton.cdiv(num_pairs + min(num_experts, num_pairs) * (block_m - 1), block_m) * block_m


def align_pairs(topk_ids: torch.Tensor, num_experts: int, block_m: int
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """topk_ids [T, k] (expert ids in [0, num_experts)) sorted by expert on the device: (pair_ids
    [max_rows] int32, pad rows num_pairs; block_expert [max_rows // block_m] int32, -1 past the end;
    num_rows [1] int64, a multiple of block_m)."""
    if topk_ids.dim() != 2 or topk_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"topk_ids must be an int32/int64 [T, k] tensor, got {topk_ids.dtype} "
                         f"{tuple(topk_ids.shape)}")
    if num_experts < 1 or block_m < 1 or block_m & (block_m - 1):
        raise ValueError(f"need num_experts >= 1 and block_m a power of two, got {num_experts}, {block_m}")
    flat = topk_ids.reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    num_pairs = flat.numel()
    device = flat.device
    max_rows = max_aligned_rows(num_pairs, num_experts, block_m)
    nb = triton.next_power_of_2(num_experts + 1)
    num_chunks = max(1, triton.cdiv(num_pairs, CHUNK))
    counts = torch.empty(num_chunks, nb, dtype=torch.int32, device=device)
    pair_ids = torch.empty(max_rows, dtype=torch.int32, device=device)
    block_expert = torch.empty(max_rows // block_m, dtype=torch.int32, device=device)
    num_rows = torch.empty(1, dtype=torch.int64, device=device)
    _chunk_counts_kernel[(num_chunks,)](flat, counts, num_pairs, num_experts, NB=nb, CHUNK=CHUNK, num_warps=4)
    _expert_offsets_kernel[(1,)](counts, pair_ids, block_expert, num_rows, num_pairs, num_chunks, num_experts,
                                 max_rows, NB=nb, BLOCK_M=block_m, BLOCK_ROWS=1024,
                                 BLOCK_B=max(16, 4096 // nb), num_warps=4)
    _place_pairs_kernel[(num_chunks,)](flat, counts, pair_ids, num_pairs, num_experts, NB=nb, CHUNK=CHUNK,
                                       num_warps=4)
    return pair_ids, block_expert, num_rows
