"""The one-launch grammar mask (kernels/token_bitmask.py) against structured/bitmask.py's unpacked
reference: a subset of rows, a vocabulary that is not a multiple of 32 (nor of the kernel's block),
rows allowing nothing but one token, all-ones rows; the other rows and allowed logits untouched."""

from __future__ import annotations

import numpy as np
import torch
from ferrox.kernels.token_bitmask import apply_token_bitmask
from ferrox.structured.bitmask import unpack_bitmask


def test_matches_unpacked_reference(kernel_device, seed):
    vocab, num_rows = 5000 + 17, 6
    words = (vocab + 31) // 32
    rng = np.random.default_rng(seed)
    full = rng.integers(-2**31, 2**31, size=(num_rows, words), dtype=np.int64).astype(np.int32)
    full[1] = 0
    full[1, 3] = 1 << 5  # only token 101 allowed
    full[4] = -1  # a constrained request whose grammar allows everything this step
    rows = np.array([0, 1, 4, 5])
    logits = torch.randn(num_rows, vocab, device=kernel_device)
    expected = logits.clone()
    allowed = unpack_bitmask(torch.from_numpy(full), vocab).to(kernel_device)
    for r in rows:
        expected[r][~allowed[r]] = float("-inf")
    apply_token_bitmask(logits, torch.from_numpy(full[rows]).to(kernel_device),
                        torch.from_numpy(rows).to(kernel_device))
    assert torch.equal(logits, expected)
    assert torch.isfinite(logits[1]).nonzero().flatten().tolist() == [101]
