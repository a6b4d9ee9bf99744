"""Weight-only FP8 products for several rows (kernels/fp8_weight_gemm.py) against float64 on the
dequantized weight: both tile shapes, K and N off the tiles, bias, fp32 and 16-bit activations, the
dequantize + cuBLAS path from DEQUANT_MIN_M rows, and the inputs it refuses. Runs on CUDA, and on
CPU in the Triton interpreter child; the real shapes on the H200."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from ferrox.kernels import fp8_weight_gemm as fwg
from ferrox.kernels.fp8_weight_gemm import GemmConfig, fp8_dequantize, fp8_weight_gemm, fp8_weight_linear

from tests.kernels.kernel_refs import relative_error
from tests.kernels.test_fp8_gemv import FP8, TOLERANCE, _fp8_weight


def _case(device, dtype, m, n, k, *, bias=False, config=None):
    w, s, w_ref = _fp8_weight(n, k, device)
    x = torch.randn(m, k, device=device).to(dtype)
    b = torch.randn(n, device=device).to(dtype) if bias else None
    out = fp8_weight_gemm(x, w, s, b, config=config)
    ref = x.double() @ w_ref.t() + (b.double() if b is not None else 0)
    assert out.shape == (m, n) and out.dtype == dtype
    assert relative_error(out, ref.to(dtype)) < TOLERANCE[dtype]


# Interpreter-sized tiles: several row and token tiles, K and N not multiples of them.
SMALL = GemmConfig(16, 32, 64, 4, 2, group_m=2)


@pytest.mark.parametrize("swap_ab", [False, True], ids=["x-w", "swapped"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemm_against_the_dequantized_weight(kernel_device, seed, dtype, swap_ab):
    config = dataclasses.replace(SMALL, swap_ab=swap_ab)
    _case(kernel_device, dtype, 37, 72, 200, bias=True, config=config)
    _case(kernel_device, dtype, 2, 40, 64, config=config)


def test_default_configs_and_the_dequantize_path(kernel_device, seed, monkeypatch):
    _case(kernel_device, torch.bfloat16, 3, 64, 256)  # the small-batch tile
    _case(kernel_device, torch.float32, 70, 128, 64)  # the swapped square tiles
    _case(kernel_device, torch.bfloat16, 130, 128, 64)
    w, s, w_ref = _fp8_weight(48, 96, kernel_device)
    deq = fp8_dequantize(w, s, torch.bfloat16)
    assert torch.equal(deq, (w.float() * s[:, None]).to(torch.bfloat16))
    monkeypatch.setattr(fwg, "DEQUANT_MIN_M", 8)  # the prefill path at a size the interpreter runs
    x = torch.randn(9, 96, device=kernel_device)
    out = fp8_weight_linear(x, w, s)
    assert relative_error(out, (x.double() @ w_ref.t()).float()) < TOLERANCE[torch.float32]


def test_bad_input_names_the_field(kernel_device):
    w = torch.zeros(8, 32, dtype=FP8, device=kernel_device)
    s = torch.ones(8, device=kernel_device)
    x = torch.zeros(2, 32, device=kernel_device)
    with pytest.raises(ValueError, match="weight must"):
        fp8_weight_gemm(x, w.float(), s)
    with pytest.raises(ValueError, match="x must"):
        fp8_weight_gemm(torch.zeros(2, 16, device=kernel_device), w, s)
    with pytest.raises(ValueError, match="weight_scale"):
        fp8_weight_gemm(x, w, s.double())
    with pytest.raises(ValueError, match="bias"):
        fp8_weight_gemm(x, w, s, torch.zeros(9, device=kernel_device))


@pytest.mark.gpu
def test_real_shapes(cuda_device, seed):
    for m in (2, 32, 33, 128, 129, 1024):
        for n, k in ((6144, 4096), (28672, 4096), (4096, 14336)):
            w, s, w_ref = _fp8_weight(n, k, cuda_device)
            x = torch.randn(m, k, device=cuda_device).to(torch.bfloat16)
            ref = (x.double() @ w_ref.t()).to(torch.bfloat16)
            assert relative_error(fp8_weight_linear(x, w, s), ref) < TOLERANCE[torch.bfloat16]
