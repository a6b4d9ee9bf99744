"""Multi-LoRA kernels: each token's adapter delta added to a projection's output, with tokens of
different adapters (and of none) mixed in one batch. The plain-torch reference and the layout of
the stacked slot weights are in lora/torch_delta.py; in short, for one wrapped projection:

  a_stack [L, S*R, in]   A of every output slice stacked (slice s: rows [s*R, (s+1)*R))
  b_stack [L, out, R]    B with the adapter's scaling baked in (slice s: rows [off_s, off_{s+1}))

Tokens are visited in an order grouped by slot: `token_order` [>= T] lists the batch's rows
(base-model rows first, then each slot's rows) and `sorted_slots` [>= T] the slot of each listed
row (-1: base model, no delta). The manager builds both on the host with each step's slots
(lora/slots.py), `sort_tokens_by_slot` on the device. The grouping is for speed only: any order
gives the same result.

Two launches per projection:

- shrink: tmp = x @ A[slot]^T, for all S slices at once: they read the same x, so q/k/v (or
  gate/up) are one gathered GEMM with N = S*R. For small batches the K axis is split across
  programs (a decode step has a handful of tokens and K = 4096: one program per tile would be a
  long serial loop); each split writes its partial sums to its own plane of an fp32 buffer, and
  expand adds the planes in a fixed order, so results do not depend on scheduling (no atomics).
- expand: y[:, slice s] += tmp[:, s*R:(s+1)*R] @ B[slot, slice s]^T, in place; a program is a
  tile of tokens x a chunk of one slice's columns, so slices of different widths (q vs k/v)
  share a launch.

A program takes BLOCK_M consecutive entries of the order, reads their slots and loops over the
distinct ones present (smallest to largest, skipping absent ones), so a tile inside one slot's
run loads that adapter's weights once, and one straddling a boundary loads each of its slots. A
tile of base rows returns at once and leaves y untouched. Nothing is read back on the host and the
grid depends only on the shapes, so a step can be captured in a CUDA graph and replayed after the
order and slots are rewritten in place.

Measured on an H200 (bf16, 4 adapters of rank 16, Llama-3.1-8B projections; CUDA-graph timing):
a decode batch of 256 tokens of mixed adapters adds about 59 us per layer to the base GEMMs'
178 us (16 tokens: 42 over 113; 1 token: 25 over 111); an 8192-token prefill of one adapter adds
about 750 us to 4790 (16%). With no adapter row in the batch the two launches cost about 3 us per
projection. The expand's read-modify-write of y dominates at large T.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

_NO_SLOT: tl.constexpr = tl.constexpr(2**30)  # larger than any slot: "no adapter row" for the tile minimum


@triton.jit
def _tile_slot_range(slots):
    """(smallest, largest) slot >= 0 in a tile; smallest > largest when every row is -1."""
    lo = tl.min(tl.where(slots >= 0, slots, _NO_SLOT), axis=0)
    hi = tl.max(slots, axis=0)
    return lo, hi


# T (tokens this step) and the partial-sum stride that follows it change every step: not specialised
# on, so a step count never compiles a new variant while serving.
@triton.jit(do_not_specialize=["T", "stride_os"])
def _shrink_kernel(
    out_ptr,  # [SPLIT_K, T, N] fp32 partial sums, by position in the order
    x_ptr,  # [T, K]
    a_ptr,  # [L, N, K]
    order_ptr,  # [>= T] int32 rows of x in slot order
    slots_ptr,  # [>= T] int32 slot of each entry of the order
    T,
    N,
    K,
    k_per_split,
    stride_xm,
    stride_al,
    stride_an,
    stride_os,
    stride_om,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    pos = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pos_ok = pos < T
    slots = tl.load(slots_ptr + pos, mask=pos_ok, other=-1)
    lo, hi = _tile_slot_range(slots)
    rows = tl.load(order_ptr + pos, mask=pos_ok & (slots >= 0), other=0)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    k_start = pid_k * k_per_split
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xm
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for slot in range(lo, hi + 1):
        take = slots == slot
        if tl.sum(take.to(tl.int32), axis=0) > 0:
            a_cols = a_ptr + tl.cast(slot, tl.int64) * stride_al + cols.to(tl.int64)[None, :] * stride_an
            for k0 in range(k_start, k_start + k_per_split, BLOCK_K):
                ks = k0 + tl.arange(0, BLOCK_K)
                k_ok = ks < K
                x = tl.load(x_rows + ks[None, :], mask=take[:, None] & k_ok[None, :], other=0.0)
                a = tl.load(a_cols + ks[:, None], mask=k_ok[:, None] & col_ok[None, :], other=0.0)  # A^T tile
                acc += tl.dot(x, a, input_precision=DOT_PRECISION)
    out = out_ptr + pid_k * stride_os + pos.to(tl.int64)[:, None] * stride_om + cols[None, :]
    tl.store(out, acc, mask=pos_ok[:, None] & col_ok[None, :])


@triton.jit(do_not_specialize=["T", "stride_ts"])
def _expand_kernel(
    y_ptr,  # [T, OUT], updated in place
    tmp_ptr,  # [SPLIT_K, T, S*R] fp32 partial sums from the shrink, by position in the order
    b_ptr,  # [L, OUT, R]
    order_ptr,  # [>= T] int32
    slots_ptr,  # [>= T] int32
    offsets_ptr,  # [S + 1] int32 column bounds of the slices
    T,
    R,
    cols_per_program,  # a multiple of BLOCK_N
    stride_ym,
    stride_ts,
    stride_tm,
    stride_bl,
    stride_bn,
    SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Program (token tile, slice, column chunk): the tile's shrunk rows are loaded once, then the
    chunk's columns are swept BLOCK_N at a time (a long sweep amortises the per-program setup
    over much of y, which is most of the traffic at large T)."""
    pid_m = tl.program_id(0)
    pid_s = tl.program_id(1)
    pid_c = tl.program_id(2)
    slice_end = tl.load(offsets_ptr + pid_s + 1)
    chunk_start = tl.load(offsets_ptr + pid_s) + pid_c * cols_per_program
    if chunk_start >= slice_end:  # the grid covers the widest slice; narrower ones end early
        return
    chunk_end = tl.minimum(chunk_start + cols_per_program, slice_end)
    pos = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pos_ok = pos < T
    slots = tl.load(slots_ptr + pos, mask=pos_ok, other=-1)
    lo, hi = _tile_slot_range(slots)
    if lo > hi:  # no adapter row in this tile
        return
    has_lora = slots >= 0
    rows = tl.load(order_ptr + pos, mask=has_lora, other=0)
    y_rows = y_ptr + rows.to(tl.int64)[:, None] * stride_ym
    rs = tl.arange(0, BLOCK_R)
    r_ok = rs < R
    t_ptrs = tmp_ptr + pos.to(tl.int64)[:, None] * stride_tm + pid_s * R + rs[None, :]
    t_mask = has_lora[:, None] & r_ok[None, :]
    shrunk = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
    for split in tl.static_range(SPLIT_K):
        shrunk += tl.load(t_ptrs + split * stride_ts, mask=t_mask, other=0.0)
    # Rounded to the weights' dtype before the second matmul, as a torch matmul chain stores it.
    # Rows of slot -1 are zero, so a tile of one adapter (and base rows) needs no per-slot mask.
    shrunk = shrunk.to(b_ptr.dtype.element_ty)
    b_rows = b_ptr + rs[:, None]
    for c0 in range(chunk_start, chunk_end, BLOCK_N):
        cols = c0 + tl.arange(0, BLOCK_N)
        col_ok = cols < chunk_end
        y_mask = has_lora[:, None] & col_ok[None, :]
        b_mask = r_ok[:, None] & col_ok[None, :]
        b_cols = b_rows + cols.to(tl.int64)[None, :] * stride_bn
        y = tl.load(y_rows + cols[None, :], mask=y_mask, other=0.0)
        if lo == hi:
            b = tl.load(b_cols + tl.cast(lo, tl.int64) * stride_bl, mask=b_mask, other=0.0)  # B^T [BLOCK_R, BLOCK_N]
            acc = tl.dot(shrunk, b, input_precision=DOT_PRECISION)
        else:
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for slot in range(lo, hi + 1):
                take = slots == slot
                if tl.sum(take.to(tl.int32), axis=0) > 0:
                    b = tl.load(b_cols + tl.cast(slot, tl.int64) * stride_bl, mask=b_mask, other=0.0)
                    acc += tl.dot(tl.where(take[:, None], shrunk, 0.0), b, input_precision=DOT_PRECISION)
        tl.store(y_rows + cols[None, :], (y.to(tl.float32) + acc).to(y_ptr.dtype.element_ty), mask=y_mask)


@dataclass(frozen=True, slots=True)
class ShrinkConfig:
    block_m: int
    block_n: int
    block_k: int
    split_k: int
    num_warps: int
    num_stages: int = 3


@dataclass(frozen=True, slots=True)
class ExpandConfig:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int = 3
    # Columns a program sweeps; None: enough programs for the GPU (about 4 per SM), at most 2048.
    cols_per_program: int | None = None


_NUM_SMS = 132  # H200; a launch of about twice as many programs keeps every SM busy


def choose_shrink_config(num_tokens: int, n: int, k: int) -> ShrinkConfig:
    """Small batches split K so that a decode step still spreads over the SMs; each split plane
    is read again by every expand program of its rows, so large batches split little or not at
    all. A split has at least two K blocks."""
    if num_tokens <= 256:
        block_m, block_n, block_k, warps, stages, max_split = 16, 16, 128, 4, 3, 16
    else:
        block_m, block_n, block_k, warps, stages, max_split = 64, min(64, triton.next_power_of_2(n)), 128, 8, 4, 4
    tiles = triton.cdiv(num_tokens, block_m) * triton.cdiv(n, block_n)
    split_k = max(1, min(triton.cdiv(2 * _NUM_SMS, tiles), k // (2 * block_k), max_split))
    if num_tokens > 2048:
        split_k = 1
    return ShrinkConfig(block_m, block_n, block_k, split_k, warps, stages)


def choose_expand_config(num_tokens: int) -> ExpandConfig:
    """Swept on an H200 (bf16, rank 16, Llama-3.1-8B projections, T = 16..8192): 16-token tiles
    and 128-column steps were best or within a few percent everywhere."""
    return ExpandConfig(16, 64, 4) if num_tokens <= 16 else ExpandConfig(16, 128, 4)


def _cols_per_program(cfg: ExpandConfig, row_tiles: int, num_slices: int, max_slice_width: int) -> int:
    if cfg.cols_per_program is not None:
        return triton.cdiv(cfg.cols_per_program, cfg.block_n) * cfg.block_n
    cols = cfg.block_n
    while cols < 2048 and cols < max_slice_width and \
            row_tiles * num_slices * triton.cdiv(max_slice_width, 2 * cols) >= 4 * _NUM_SMS:
        cols *= 2
    return cols


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 tests must not silently drop to tf32 on the GPU.
    return "ieee" if dtype == torch.float32 else "tf32"


def sort_tokens_by_slot(token_slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(token_order, sorted_slots), int32, from each token's slot, on the device (no host sync):
    base rows first, then each slot's rows in batch order."""
    sorted_slots, order = torch.sort(token_slots, stable=True)
    return order.to(torch.int32), sorted_slots.to(torch.int32)


def lora_shrink(x: torch.Tensor, a_stack: torch.Tensor, token_order: torch.Tensor, sorted_slots: torch.Tensor,
                config: ShrinkConfig | None = None) -> torch.Tensor:
    """Partial sums [split_k, T, S*R] (fp32) of x[token_order[p]] @ A[sorted_slots[p]]^T per position
    p of the order; their sum over axis 0 is the shrunk activations (zero where the slot is -1)."""
    num_tokens, k = x.shape
    num_slots, n, k_a = a_stack.shape
    if k_a != k or x.stride(-1) != 1 or not a_stack.is_contiguous():
        raise ValueError(f"lora_shrink: x {tuple(x.shape)} (contiguous last axis) and a_stack [L, N, {k}] "
                         f"(contiguous) expected, got a_stack {tuple(a_stack.shape)}")
    cfg = config or choose_shrink_config(num_tokens, n, k)
    k_per_split = triton.cdiv(triton.cdiv(k, cfg.split_k), cfg.block_k) * cfg.block_k
    split_k = triton.cdiv(k, k_per_split)
    out = torch.empty(split_k, num_tokens, n, dtype=torch.float32, device=x.device)
    if num_tokens == 0:
        return out
    grid = (triton.cdiv(num_tokens, cfg.block_m), triton.cdiv(n, cfg.block_n), split_k)
    _shrink_kernel[grid](
        out, x, a_stack, token_order, sorted_slots, num_tokens, n, k, k_per_split, x.stride(0), a_stack.stride(0),
        a_stack.stride(1), out.stride(0), out.stride(1), BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k, DOT_PRECISION=_dot_precision(x.dtype), num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return out


def lora_expand(y: torch.Tensor, shrunk: torch.Tensor, b_stack: torch.Tensor, token_order: torch.Tensor,
                sorted_slots: torch.Tensor, slice_offsets: torch.Tensor, max_slice_width: int,
                config: ExpandConfig | None = None) -> torch.Tensor:
    """y[token_order[p], slice s] += shrunk[p, s*R:(s+1)*R] @ B[sorted_slots[p], slice s]^T for
    positions with a slot, in place. shrunk: lora_shrink's partial sums; slice_offsets: int32
    [S + 1] on y's device; max_slice_width: the widest slice (sizes the grid: a host int)."""
    num_tokens, out_features = y.shape
    num_slots, out_b, rank = b_stack.shape
    num_slices = slice_offsets.shape[0] - 1
    if out_b != out_features or shrunk.shape[1:] != (num_tokens, num_slices * rank) or y.stride(-1) != 1 \
            or not b_stack.is_contiguous() or not shrunk.is_contiguous():
        raise ValueError(f"lora_expand: y {tuple(y.shape)}, shrunk {tuple(shrunk.shape)} and b_stack "
                         f"{tuple(b_stack.shape)} do not fit {num_slices} slice(s) of rank {rank}")
    if num_tokens == 0:
        return y
    cfg = config or choose_expand_config(num_tokens)
    row_tiles = triton.cdiv(num_tokens, cfg.block_m)
    cols = _cols_per_program(cfg, row_tiles, num_slices, max_slice_width)
    grid = (row_tiles, num_slices, triton.cdiv(max_slice_width, cols))
    _expand_kernel[grid](
        y, shrunk, b_stack, token_order, sorted_slots, slice_offsets, num_tokens, rank, cols, y.stride(0),
        shrunk.stride(0), shrunk.stride(1), b_stack.stride(0), b_stack.stride(1), SPLIT_K=shrunk.shape[0],
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_R=max(16, triton.next_power_of_2(rank)),
        DOT_PRECISION=_dot_precision(y.dtype), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return y


def add_lora(y: torch.Tensor, x: torch.Tensor, a_stack: torch.Tensor, b_stack: torch.Tensor,
             token_order: torch.Tensor, sorted_slots: torch.Tensor, slice_offsets: torch.Tensor,
             slice_widths: Sequence[int]) -> torch.Tensor:
    """y [T, out] += each token's adapter delta (the contract of lora/torch_delta.add_lora_torch,
    with the slots given as token_order / sorted_slots), in place, in two launches; returns y.
    slice_offsets: int32 [S + 1] on the device, the same bounds as the host-side slice_widths."""
    shrunk = lora_shrink(x, a_stack, token_order, sorted_slots)
    return lora_expand(y, shrunk, b_stack, token_order, sorted_slots, slice_offsets, max(slice_widths))
