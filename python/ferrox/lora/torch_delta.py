"""The multi-LoRA delta in plain torch: the CPU path, and the reference the Triton kernels
(kernels/lora.py) are tested against. Same contract as `kernels.lora.add_lora`.

Layout of one wrapped projection (L slots, rank padded to R, S output slices of widths w_s):
  a_stack [L, S*R, in]   rows [s*R, (s+1)*R) are slice s's A (zero past the adapter's rank)
  b_stack [L, out, R]    rows [off_s, off_s + w_s) are slice s's B, adapter scaling baked in
  token_slots [>= T]     int32, each token's slot; -1: the base model (no delta)

  y[t, off_s:off_s+w_s] += B[slot_t, off_s:off_s+w_s] @ (A[slot_t, s*R:(s+1)*R] @ x[t])

Rows are grouped by slot (a gather and two matmuls per adapter present), so a batch costs as many
matmul pairs as it has distinct adapters, not tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

# (slot, rows of the batch that run it); rows is an int64 index tensor on the batch's device.
SlotGroups = list[tuple[int, torch.Tensor]]


def slot_groups(token_slots: torch.Tensor) -> SlotGroups:
    """The rows of each slot present in token_slots (reads it on the host: a device sync on GPU)."""
    slots = token_slots.to(torch.int64)
    return [(int(s), (slots == s).nonzero().flatten()) for s in torch.unique(slots).tolist() if s >= 0]


def add_lora_torch(y: torch.Tensor, x: torch.Tensor, a_stack: torch.Tensor, b_stack: torch.Tensor,
                   token_slots: torch.Tensor, slice_offsets: Sequence[int],
                   groups: SlotGroups | None = None) -> torch.Tensor:
    """y [T, out] += each token's adapter delta, in place; returns y.

    slice_offsets: output column bounds of the slices, (0, w_0, w_0 + w_1, ..., out).
    groups: `slot_groups(token_slots[:T])` when the caller has it already (once per step)."""
    num_tokens = x.shape[0]
    if groups is None:
        groups = slot_groups(token_slots[:num_tokens])
    rank = b_stack.shape[-1]
    for slot, rows in groups:
        whole = rows.numel() == num_tokens  # one adapter for the whole batch: no gather
        xs = x if whole else x.index_select(0, rows)
        shrunk = xs @ a_stack[slot].t()  # [n, S*R]
        delta = torch.empty(xs.shape[0], y.shape[1], dtype=y.dtype, device=y.device)
        for s in range(len(slice_offsets) - 1):
            lo, hi = slice_offsets[s], slice_offsets[s + 1]
            torch.matmul(shrunk[:, s * rank:(s + 1) * rank], b_stack[slot, lo:hi].t(), out=delta[:, lo:hi])
        if whole:
            y.add_(delta)
        else:
            y.index_add_(0, rows, delta)
    return y
