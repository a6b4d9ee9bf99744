"""The model's GPU rotary path (layers/ops.py TritonOps.rope: RotaryEmbedding.rope_rows + the Triton
rotary_neox_ kernel, rotating q and k in place inside the fused qkv tensor) equals the torch
formula it replaces (DeviceOps.rope: cos_sin + apply_rotary), with and without Llama 3.1 frequency
scaling, with YaRN's scaled cos / sin, and with partial rotary's unturned pairs. Runs on CUDA, or on CPU in the Triton interpreter child (see conftest.py)."""

from __future__ import annotations

import pytest
import torch
from ferrox.layers.ops import CosSinRope, KernelRope, for_device
from ferrox.layers.rotary import RotaryEmbedding, apply_rotary

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}


YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}  # cos, sin scaled too


@pytest.mark.parametrize("scaling, rotary_dim", [(None, None), (LLAMA3, None), (YARN, None), (YARN, 32)])
def test_kernel_rope_rotates_like_the_torch_formula(kernel_device, seed, scaling, rotary_dim):
    triton_ops, torch_ops = for_device(kernel_device, "triton"), for_device(kernel_device, "torch")
    rotary = RotaryEmbedding(64, 500000.0, scaling, kernel_device, triton_ops, rotary_dim=rotary_dim)
    tokens, heads, kv_heads, head_dim = 7, 4, 2, 64
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, device=kernel_device)
    positions = torch.tensor([0, 1, 5, 100, 4000, 3, 17], device=kernel_device)
    qk_size = (heads + kv_heads) * head_dim

    reference = torch_ops.rope(rotary, positions, torch.float32)
    assert isinstance(reference, CosSinRope)
    cos, sin = rotary.cos_sin(positions, torch.float32)
    expected = apply_rotary(qkv[:, :qk_size].view(tokens, heads + kv_heads, head_dim), cos, sin)
    ref_q, ref_k = reference.rotate_qk(qkv[:, :qk_size].view(tokens, heads + kv_heads, head_dim), heads)
    assert torch.equal(ref_q, expected[:, :heads]) and torch.equal(ref_k, expected[:, heads:])

    rope = rotary(positions, torch.float32)
    assert isinstance(rope, KernelRope)
    got = qkv.clone()
    q, k = rope.rotate_qk(got[:, :qk_size].view(tokens, heads + kv_heads, head_dim), heads)
    assert q.data_ptr() == got.data_ptr()  # rotated in place inside qkv
    torch.testing.assert_close(got[:, :qk_size].view_as(expected), expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k, expected[:, heads:], rtol=1e-5, atol=1e-5)
    assert torch.equal(got[:, qk_size:], qkv[:, qk_size:])  # v untouched

    # q and k held apart (Qwen3's path after its per-head norms) rotate the same way.
    q2, k2 = rope.rotate(qkv[:, :heads * head_dim].reshape(tokens, heads, head_dim),
                         qkv[:, heads * head_dim:qk_size].reshape(tokens, kv_heads, head_dim))
    torch.testing.assert_close(torch.cat((q2, k2), dim=1), expected, rtol=1e-5, atol=1e-5)
