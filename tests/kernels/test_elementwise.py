"""Fused RMSNorm(+residual), SiLU-and-mul and neox rotary against plain torch."""

from __future__ import annotations

import os

import pytest
import torch
from ferrox.kernels.activation import silu_and_mul
from ferrox.kernels.rmsnorm import fused_add_rms_norm, rms_norm
from ferrox.kernels.rotary import neox_cos_sin_cache, rope_inv_freq, rotary_neox_

from tests.kernels.kernel_refs import relative_error, rms_norm_ref, rotary_neox_ref, silu_and_mul_ref

LLAMA31_ROPE_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
# Activation-dtype results may differ from the reference by one rounding step.
TOLERANCE = {torch.float32: 1e-6, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def _rms_norm_case(device, dtype, tokens, hidden):
    x = torch.randn(tokens, hidden, dtype=dtype, device=device)
    residual = torch.randn_like(x)
    weight = (1 + 0.1 * torch.randn(hidden, device=device)).to(dtype)
    out, new_residual = fused_add_rms_norm(x, residual, weight, 1e-5)
    ref_out, ref_residual = rms_norm_ref(x, weight, 1e-5, residual)
    assert torch.equal(new_residual, ref_residual)  # one rounded add: bit-exact
    assert relative_error(out, ref_out) < TOLERANCE[dtype]
    assert relative_error(rms_norm(x, weight, 1e-5), rms_norm_ref(x, weight, 1e-5)) < TOLERANCE[dtype]


def _silu_case(device, dtype, tokens, inter):
    x = torch.randn(tokens, 2 * inter, dtype=dtype, device=device)
    assert relative_error(silu_and_mul(x), silu_and_mul_ref(x)) < TOLERANCE[dtype]


def _rotary_case(device, dtype, tokens, heads, kv_heads, head_dim, rot_dim, max_pos, scaling):
    cache = neox_cos_sin_cache(rot_dim, max_pos, 500000.0, scaling, device=device)
    positions = torch.randint(0, max_pos, (tokens,), device=device)
    q = torch.randn(tokens, heads, head_dim, dtype=dtype, device=device)
    k = torch.randn(tokens, kv_heads, head_dim, dtype=dtype, device=device)
    ref_q, ref_k = rotary_neox_ref(positions, q, cache), rotary_neox_ref(positions, k, cache)
    rotary_neox_(positions, q, k, cache)
    assert relative_error(q, ref_q) < TOLERANCE[dtype]
    assert relative_error(k, ref_k) < TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
def test_elementwise_kernels_tiny(kernel_device, seed, dtype):
    if dtype == torch.bfloat16 and kernel_device.type == "cpu":
        pytest.skip("the Triton interpreter rounds float32 -> bf16 differently from the GPU (seen with 3.9)")
    _rms_norm_case(kernel_device, dtype, tokens=5, hidden=96)  # hidden not a power of two
    _silu_case(kernel_device, dtype, tokens=3, inter=70)
    _rotary_case(kernel_device, dtype, 4, heads=6, kv_heads=2, head_dim=32, rot_dim=32, max_pos=64, scaling=None)
    _rotary_case(kernel_device, dtype, 3, heads=2, kv_heads=1, head_dim=24, rot_dim=16, max_pos=32, scaling=None)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_elementwise_kernels_llama8b_shapes(cuda_device, seed, dtype):
    _rms_norm_case(cuda_device, dtype, tokens=2048, hidden=4096)
    _silu_case(cuda_device, dtype, tokens=2048, inter=14336)
    _rotary_case(cuda_device, dtype, 2048, 32, 8, 128, 128, 131072, LLAMA31_ROPE_SCALING)


def test_poisoned_outputs_are_fully_written(kernel_device, seed):
    """Every output element comes from the kernel: results would be NaN if a tile were skipped."""
    x = torch.randn(7, 2 * 300, device=kernel_device)
    assert not silu_and_mul(x).isnan().any()
    out, residual = fused_add_rms_norm(x[:, :300].contiguous(), x[:, 300:].contiguous(), torch.ones(300, device=kernel_device), 1e-6)
    assert not out.isnan().any() and not residual.isnan().any()


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="pure torch: runs in the parent only")
def test_llama31_cos_sin_cache_matches_transformers():
    """The Llama 3.1 frequency rescale matches transformers' own implementation."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = LlamaConfig(
        hidden_size=4096, num_attention_heads=32, rope_theta=500000.0, rope_scaling=dict(LLAMA31_ROPE_SCALING),
        max_position_embeddings=131072,
    )
    expected, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")  # float32
    torch.testing.assert_close(rope_inv_freq(128, 500000.0, LLAMA31_ROPE_SCALING).float(), expected, rtol=1e-6, atol=0)


@pytest.mark.gpu
def test_layers_dispatch_to_triton_on_cuda(cuda_device, seed):
    """layers.RMSNorm / SiluAndMul built for CUDA take the Triton path and still match the references."""
    from ferrox.layers.activation import SiluAndMul
    from ferrox.layers.layernorm import RMSNorm
    from ferrox.layers.ops import for_device

    x = torch.randn(64, 4096, dtype=torch.bfloat16, device=cuda_device)
    residual = torch.randn_like(x)
    norm = RMSNorm(4096, 1e-5, torch.bfloat16, cuda_device)
    assert norm.ops.name == "triton"  # chosen from the device when the layer is built
    norm.weight.data.normal_(1.0, 0.1)
    out, new_residual = norm(x, residual)
    ref_out, ref_residual = rms_norm_ref(x, norm.weight, 1e-5, residual)
    assert torch.equal(new_residual, ref_residual) and relative_error(out, ref_out) < TOLERANCE[torch.bfloat16]
    assert relative_error(norm(x), rms_norm_ref(x, norm.weight, 1e-5)) < TOLERANCE[torch.bfloat16]
    gate_up = torch.randn(64, 2 * 1024, dtype=torch.bfloat16, device=cuda_device)
    act = SiluAndMul(for_device(cuda_device))
    assert relative_error(act(gate_up), silu_and_mul_ref(gate_up)) < TOLERANCE[torch.bfloat16]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_triton_ops_match_torch_ops(kernel_device, seed, dtype):
    """The two op sets of layers/ops.py agree, and the Triton set hands what its kernels do not
    take (3-D views, a residual of another dtype, a strided last axis) to the torch formula."""
    from ferrox.layers.ops import DeviceOps, TritonOps, for_device

    triton_ops, torch_ops = for_device(kernel_device, "triton"), for_device(kernel_device, "torch")
    assert isinstance(triton_ops, TritonOps) and type(torch_ops) is DeviceOps
    tol = TOLERANCE[dtype] * 4
    x = torch.randn(5, 96, dtype=dtype, device=kernel_device)
    residual = torch.randn_like(x)
    weight = (1 + 0.1 * torch.randn(96, device=kernel_device)).to(dtype)
    assert relative_error(triton_ops.rms_norm(x, weight, 1e-6), torch_ops.rms_norm(x, weight, 1e-6)) < tol
    out, res = triton_ops.fused_add_rms_norm(x, residual, weight, 1e-6)
    ref_out, ref_res = torch_ops.fused_add_rms_norm(x, residual, weight, 1e-6)
    assert torch.equal(res, ref_res) and relative_error(out, ref_out) < tol
    gate_up = torch.randn(5, 2 * 48, dtype=dtype, device=kernel_device)
    assert relative_error(triton_ops.silu_and_mul(gate_up), torch_ops.silu_and_mul(gate_up)) < tol

    heads = x.view(5, 3, 32)  # a 3-D input (per-head norms): the torch formula, bit for bit
    head_w = weight[:32]
    assert torch.equal(triton_ops.rms_norm(heads, head_w, 1e-6), torch_ops.rms_norm(heads, head_w, 1e-6))
    other = residual.double()
    assert all(torch.equal(a, b) for a, b in zip(triton_ops.fused_add_rms_norm(x, other, weight, 1e-6),
                                                  torch_ops.fused_add_rms_norm(x, other, weight, 1e-6), strict=True))
    strided = gate_up.t().contiguous().t()
    assert torch.equal(triton_ops.silu_and_mul(strided), torch_ops.silu_and_mul(strided))
