"""Bitmask unpack/apply: the CPU (numpy) and torch (GPU) paths against llguidance's reference."""

from __future__ import annotations

import llguidance.numpy as llg_np
import numpy as np
import pytest
import torch
from ferrox.structured.bitmask import apply_bitmask_rows, apply_token_bitmask, unpack_bitmask


def test_apply_bitmask_matches_llguidance_reference():
    rng = np.random.default_rng(0)
    vocab = 1000
    bitmask = rng.integers(-(2**31), 2**31, size=(5, (vocab + 31) // 32), dtype=np.int64).astype(np.int32)
    bitmask[2] = -1
    logits = rng.standard_normal((5, vocab)).astype(np.float32)
    expected = logits.copy()
    llg_np.apply_token_bitmask_inplace(expected, bitmask)
    ours = torch.from_numpy(logits.copy())
    apply_bitmask_rows(ours, torch.from_numpy(bitmask), None)
    assert np.array_equal(ours.numpy(), expected)
    ours = torch.from_numpy(logits.copy())
    apply_bitmask_rows(ours, torch.from_numpy(bitmask), torch.tensor([0, 1, 3, 4]))
    assert np.array_equal(ours.numpy(), expected)


def test_unpack_bitmask_matches_numpy_reference():
    """The shift-and-compare unpacking (the GPU path) against numpy's unpackbits."""
    rng = np.random.default_rng(1)
    vocab = 1000
    bitmask = rng.integers(-(2**31), 2**31, size=(3, (vocab + 31) // 32), dtype=np.int64).astype(np.int32)
    expected = np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little")[:, :vocab].astype(bool)
    assert np.array_equal(unpack_bitmask(torch.from_numpy(bitmask), vocab).numpy(), expected)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_apply_bitmask_on_gpu_matches_cpu():
    rng = np.random.default_rng(2)
    vocab = 49152
    bitmask = torch.from_numpy(
        rng.integers(-(2**31), 2**31, size=(6, vocab // 32), dtype=np.int64).astype(np.int32)
    )
    bitmask[1] = -1
    logits = torch.randn(6, vocab)
    expected = logits.clone()
    apply_token_bitmask(expected, bitmask)
    on_gpu = logits.cuda()
    apply_token_bitmask(on_gpu, bitmask)
    assert torch.equal(on_gpu.cpu(), expected)
    on_gpu = logits.cuda()
    apply_bitmask_rows(on_gpu, bitmask, torch.tensor([0, 2, 5]))
    expected = logits.clone()
    apply_bitmask_rows(expected, bitmask, torch.tensor([0, 2, 5]))
    assert torch.equal(on_gpu.cpu(), expected)
