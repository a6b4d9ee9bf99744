"""Token bitmask helpers: the packed allow-list a grammar produces, applied to the logits.

Layout (llguidance's): int32 [num_reqs, ceil(vocab / 32)], bit j of word w allows token
32 * w + j. A row of all ones (-1) allows everything.
"""

from __future__ import annotations

import numpy as np
import torch


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


_BIT_CACHE: dict[torch.device, torch.Tensor] = {}


def _bits(device: torch.device) -> torch.Tensor:
    bits = _BIT_CACHE.get(device)
    if bits is None:
        bits = torch.arange(32, dtype=torch.int32, device=device)
        _BIT_CACHE[device] = bits
    return bits


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """bool [rows, vocab_size]: True where the token is allowed."""
    bits = _bits(bitmask.device)
    allowed = (bitmask.unsqueeze(-1) >> bits) & 1  # [rows, words, 32]
    return allowed.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()


def apply_bitmask_rows(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None) -> None:
    """Set disallowed logits to -inf in place.

    logits: float [num_reqs, vocab] on any device; bitmask: int32 [num_reqs, words] (filled on
    the CPU); rows: int64 indices of the constrained rows, or None for all rows. Only those rows
    are unpacked, so a mostly-free batch pays for its constrained rows alone.
    """
    if logits.dim() != 2 or bitmask.dim() != 2 or bitmask.shape[0] != logits.shape[0]:
        raise ValueError(f"bitmask {tuple(bitmask.shape)} does not match logits {tuple(logits.shape)}")
    vocab = logits.shape[1]
    if bitmask.shape[1] * 32 < vocab:
        raise ValueError(f"bitmask covers {bitmask.shape[1] * 32} tokens, logits have {vocab}")
    if logits.device.type == "cpu":
        _apply_cpu(logits, bitmask.cpu(), rows)
        return
    bitmask = bitmask.to(logits.device, non_blocking=True)
    if rows is None:
        logits.masked_fill_(~unpack_bitmask(bitmask, vocab), float("-inf"))
        return
    rows = rows.to(logits.device, non_blocking=True)
    allowed = unpack_bitmask(bitmask.index_select(0, rows), vocab)
    sub = logits.index_select(0, rows).masked_fill_(~allowed, float("-inf"))
    logits.index_copy_(0, rows, sub)


def _apply_cpu(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None) -> None:
    # numpy's unpackbits is a tight C loop: unpacking the *inverted* words yields the disallowed
    # mask directly as 0/1 bytes, which torch reads as bool without a copy. This is several
    # times faster on CPU than the shift-and-compare used on GPU.
    words = bitmask.numpy() if rows is None else bitmask.numpy()[rows.numpy()]
    disallowed_bytes = np.unpackbits(np.invert(words).view(np.uint8), axis=1, bitorder="little")
    disallowed = torch.from_numpy(disallowed_bytes).view(torch.bool)[:, : logits.shape[1]]
    if rows is None:
        logits.masked_fill_(disallowed, float("-inf"))
        return
    for j, row in enumerate(rows.tolist()):
        logits[row].masked_fill_(disallowed[j], float("-inf"))


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """apply_bitmask_rows on the constrained rows only (those not all ones). The row scan runs
    where the bitmask lives (the CPU, as filled), before anything moves to the logits' device."""
    constrained = (bitmask != -1).any(dim=1)
    rows = torch.nonzero(constrained).flatten()
    if rows.numel() == 0:
        return
    apply_bitmask_rows(logits, bitmask, None if rows.numel() == bitmask.shape[0] else rows)
