"""The model's GPU rotary path (RotaryEmbedding.kernel_rows + the Triton rotary_neox_ kernel,
rotating q and k in place inside the fused qkv tensor) equals the torch formula it replaces
(cos_sin + apply_rotary), with and without Llama 3.1 frequency scaling. Runs on CUDA, or on CPU in
the Triton interpreter child (see conftest.py)."""

from __future__ import annotations

import pytest
import torch
from ferrox.kernels.rotary import rotary_neox_
from ferrox.layers.rotary import RotaryEmbedding, apply_rotary

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}


@pytest.mark.parametrize("scaling", [None, LLAMA3])
def test_kernel_rows_rotate_like_the_torch_formula(kernel_device, seed, scaling):
    rotary = RotaryEmbedding(64, 500000.0, scaling, kernel_device)
    tokens, heads, kv_heads, head_dim = 7, 4, 2, 64
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, device=kernel_device)
    positions = torch.tensor([0, 1, 5, 100, 4000, 3, 17], device=kernel_device)
    cos, sin = rotary.cos_sin(positions, torch.float32)
    qk_size = (heads + kv_heads) * head_dim
    expected = apply_rotary(qkv[:, :qk_size].view(tokens, heads + kv_heads, head_dim), cos, sin)
    got = qkv.clone()
    rope = rotary.kernel_rows(positions)
    rotary_neox_(rope.index, got[:, : heads * head_dim].view(tokens, heads, head_dim),
                 got[:, heads * head_dim : qk_size].view(tokens, kv_heads, head_dim), rope.rows)
    torch.testing.assert_close(got[:, :qk_size].view_as(expected), expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(got[:, qk_size:], qkv[:, qk_size:])  # v untouched
