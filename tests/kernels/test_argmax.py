"""Greedy sampling's split-row argmax (kernels/argmax.py) against torch.argmax: the first index of
the largest value, across slice edges and programs; ties, all -inf rows, NaN, every logits dtype;
and the counters left at zero, so a second launch over other rows is right too."""

from __future__ import annotations

import pytest
import torch
from ferrox.kernels.argmax import argmax_rows, split_for_vocab


@pytest.mark.parametrize(("batch", "vocab"), [(1, 1), (3, 100), (2, 9000), (4, 33000)])
def test_argmax_rows_matches_torch(kernel_device, seed, batch, vocab):
    logits = torch.randn(batch, vocab, device=kernel_device) * 3
    assert torch.equal(argmax_rows(logits), logits.argmax(dim=-1))


def test_argmax_rows_ties_infinities_and_nan(kernel_device, seed):
    vocab = 33000  # split 8: slices of 5 x 1024 logits, the last ones past the row
    assert split_for_vocab(vocab) == 8
    logits = torch.randn(5, vocab, device=kernel_device)
    logits[0, [31000, 4100, 4099, 20000]] = 50.0  # ties in three slices: the first wins
    logits[1] = float("-inf")  # nothing finite: index 0, as torch
    logits[2, 7] = float("inf")
    logits[2, 17000] = float("inf")
    logits[3, 12345] = float("nan")  # NaN propagates: its index
    logits[4, vocab - 1] = 80.0  # the row's last logit, in the last partly-filled slice
    want = torch.tensor([4099, 0, 7, 12345, vocab - 1])
    assert torch.equal(argmax_rows(logits).cpu(), want)
    assert torch.equal(logits.argmax(dim=-1).cpu(), want)
    # A second launch (counters left at zero by the first), fewer rows, half precision.
    half = logits[[4, 0]].to(torch.bfloat16)
    assert torch.equal(argmax_rows(half).cpu(), torch.tensor([vocab - 1, 4099]))


def test_argmax_rows_refuses_strided_rows(kernel_device):
    with pytest.raises(ValueError, match="contiguous last axis"):
        argmax_rows(torch.zeros(4, 6, device=kernel_device)[:, ::2])
