"""Block-wise FP8 one-token steps: the split-K tensor-core product (kernels/w8a8_dot_gemv.py with
`block`) quantizes each K tile of the (normed) token as its own group and applies the group's and the
weight block's scales to that tile's partial sum, as the batched path (kernels/fp8_block_gemm.py)
does; against a float64 reference on the same codes and against the batched path. A tiny Llama with
block-FP8 layers takes the fused one-token path and matches the general path. Runs on CUDA, and on
CPU in the Triton interpreter child; the real shapes on a GPU."""

from __future__ import annotations

import pytest
import torch
from ferrox.kernels.fp8_block_gemm import dequantize_fp8_blocks, fp8_block_linear, quantize_fp8_groups_torch
from ferrox.kernels.split_k import _COUNTERS
from ferrox.kernels.w8a8_dot_gemv import DotGemvConfig, w8a8_dot_gemv
from ferrox.layers.quant.fp8_block import Fp8BlockConfig, Fp8BlockLinear, quantize_fp8_blocks

from tests.kernels.kernel_refs import relative_error, rms_norm_ref, silu_and_mul_ref
from tests.kernels.test_fused_decode import assert_fused_path_matches, quantized_models

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def _block_weight(n: int, k: int, block, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 [n, k], float32 block scales) from rows of unequal size."""
    w = torch.randn(n, k, device=device) / k ** 0.5 * (1 + torch.rand(n, 1, device=device) * 4)
    return quantize_fp8_blocks(w, block)


def _case(device, dtype, n, k, block, *, norm=False, residual=False, bias=False, silu=False, config=None):
    x = torch.randn(1, k, dtype=dtype, device=device)
    g = (1 + 0.1 * torch.randn(k, device=device)).to(dtype) if norm else None
    w, s = _block_weight(n, k, block, device)
    b = torch.randn(n, device=device).to(dtype) if bias else None
    n_out = n // 2 if silu else n
    res = torch.randn(1, n_out, dtype=dtype, device=device) if residual else None
    out = w8a8_dot_gemv(x, w, s, b, norm_weight=g, eps=1e-5, silu_mul=silu, residual=res, block=block, config=config)
    assert out.shape == (1, n_out) and out.dtype == dtype and not out.isnan().any()

    xin = rms_norm_ref(x, g, 1e-5) if norm else x  # (rounded to the dtype, as the kernel)
    q, q_scale = quantize_fp8_groups_torch(xin, block[1])
    x_deq = q.double() * q_scale.double().repeat_interleave(block[1], dim=1)[:, :k]
    ref = x_deq @ dequantize_fp8_blocks(w, s, block, torch.float64).t() + (b.double() if b is not None else 0)
    if silu:
        ref = silu_and_mul_ref(ref.to(dtype))
    if res is not None:
        ref = ref.to(dtype) + res
    assert relative_error(out, ref.to(dtype)) < TOLERANCE[dtype]
    if not (norm or silu or residual):  # the batched path on the same token
        batched = fp8_block_linear(x, w, s, block, b)
        assert relative_error(out, batched) < TOLERANCE[dtype]


SPLITS = [DotGemvConfig(16, 32, 1, 4), DotGemvConfig(32, 32, 4, 4), DotGemvConfig(16, 32, 3, 4, 2)]


@pytest.mark.parametrize("config", SPLITS, ids=["whole-k", "split4", "split3-uneven"])
def test_block_scales_plain_and_split(kernel_device, seed, config):
    # 200: the last group is short; blocks of 16 rows under 32-row tiles, of 64 over 16-row ones.
    _case(kernel_device, torch.float32, 48, 200, (16, 32), config=config)
    _case(kernel_device, torch.float32, 80, 256, (64, 64), bias=True, config=config)
    _case(kernel_device, torch.bfloat16, 32, 128, (32, 32), bias=True, config=config)
    assert not _COUNTERS.get(kernel_device, 4).any()  # every launch leaves its counters at zero


def test_block_scales_fused_prologue_and_epilogues(kernel_device, seed):
    cfg = SPLITS[1]
    _case(kernel_device, torch.float32, 64, 256, (16, 32), norm=True, silu=True, bias=True, config=cfg)
    _case(kernel_device, torch.float32, 48, 160, (16, 32), norm=True, residual=True, config=cfg)


def test_block_scales_bad_input(kernel_device):
    w = torch.zeros(32, 64, device=kernel_device).to(torch.float8_e4m3fn)
    x = torch.zeros(1, 64, device=kernel_device)
    with pytest.raises(ValueError, match=r"block scales must be float32 \[2, 2\]"):
        w8a8_dot_gemv(x, w, torch.ones(32, device=kernel_device), block=(16, 32))
    with pytest.raises(ValueError, match="from 16 rows and 32 columns"):
        w8a8_dot_gemv(x, w, torch.ones(2, 4, device=kernel_device), block=(16, 16))
    with pytest.raises(ValueError, match="dynamic"):
        w8a8_dot_gemv(x, w, torch.ones(2, 2, device=kernel_device), block=(16, 32),
                      input_scale=torch.ones(1, device=kernel_device))


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen3ForCausalLM"])
def test_fused_one_token_path_runs_block_fp8_layers(kernel_device, monkeypatch, arch):
    """A tiny Llama / Qwen3 (Qwen3-*-FP8's family: per-head q/k norms after the qkv product) with
    block-FP8 layers (dummy weights, 16 x 32 blocks; down's 48 inputs end on a short group): the
    Triton set takes the fused one-token path, the torch set the general one."""
    ref, fused = quantized_models(kernel_device, Fp8BlockConfig((16, 32)), arch)
    assert isinstance(fused.model.layers[0].mlp.down_proj.quant, Fp8BlockLinear)
    assert_fused_path_matches(ref, fused, kernel_device, monkeypatch)


@pytest.mark.gpu
def test_block_scales_llama8b_shapes(cuda_device, seed):
    dtype, block = torch.bfloat16, (128, 128)
    _case(cuda_device, dtype, 6144, 4096, block, norm=True)  # qkv
    _case(cuda_device, dtype, 4096, 4096, block, residual=True)  # o_proj
    _case(cuda_device, dtype, 2 * 14336, 4096, block, norm=True, silu=True)  # gate_up
    _case(cuda_device, dtype, 4096, 14336, block, residual=True)  # down
    _case(cuda_device, dtype, 4096, 4096, block)  # against the batched path too
