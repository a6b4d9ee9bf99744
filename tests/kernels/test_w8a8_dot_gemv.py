"""The tensor-core FP8 one-token product (kernels/w8a8_dot_gemv.py) against torch on the dequantized
weight and the fp8-quantized input (a quantizer written here): split and unsplit K, the RMSNorm
prologue, SiLU * up, bias, residual, a static input scale; the split-K counters are left at zero for
the next launch. Runs on CUDA, and on CPU in the Triton interpreter child."""

from __future__ import annotations

import pytest
import torch
from ferrox.kernels.split_k import _COUNTERS
from ferrox.kernels.w8a8_dot_gemv import DotGemvConfig, w8a8_dot_gemv

from tests.kernels.kernel_refs import relative_error, rms_norm_ref, silu_and_mul_ref
from tests.kernels.test_fp8_gemv import FP8, gemv_inputs


def _quantize_token_ref(x: torch.Tensor, scale: torch.Tensor | None) -> tuple[torch.Tensor, float]:
    """x [1, K] float -> (its fp8 codes as float64, the scale): per token absmax -> 448, or static."""
    s = float(scale) if scale is not None else max(x.abs().max().item(), 1e-12) / 448.0
    return (x / s).clamp(-448, 448).to(FP8).double(), s


def _case(device, dtype, n, k, *, norm=False, residual=False, bias=False, silu=False, static=False, config=None):
    x, g, w, s, w_ref, b, res, n_out = gemv_inputs(device, dtype, n, k, norm=norm, residual=residual, bias=bias,
                                                  silu=silu)
    in_scale = torch.tensor([0.02], device=device) if static else None
    out = w8a8_dot_gemv(x, w, s, b, norm_weight=g, eps=1e-5, silu_mul=silu, residual=res, input_scale=in_scale,
                       config=config)

    xin = rms_norm_ref(x, g, 1e-5).float() if norm else x.float()  # (rounded to the dtype, as the kernel)
    codes, x_scale = _quantize_token_ref(xin, in_scale)
    ref = (codes @ w_ref.t()) * x_scale + (b.double() if b is not None else 0)
    if silu:
        ref = silu_and_mul_ref(ref.to(dtype))
    if res is not None:
        ref = ref.to(dtype) + res
    assert out.shape == (1, n_out) and out.dtype == dtype and not out.isnan().any()
    # The same codes as the reference's (bf16: the roundings of the sums and the epilogue).
    assert relative_error(out, ref.to(dtype)) < (2e-2 if dtype == torch.bfloat16 else 1e-3)
    # Against the unquantized input: a bound for gross errors only (e4m3 inputs cost ~3% per element,
    # more after SiLU on small rows; the check above against the same codes is the exact one).
    exact = xin.double() @ w_ref.t() + (b.double() if b is not None else 0)
    if silu:
        exact = silu_and_mul_ref(exact.to(dtype))
    if res is not None:
        exact = exact.to(dtype) + res
    assert relative_error(out, exact.to(dtype)) < 0.25


# Small enough for the interpreter; block_n 16 and k 512 give several row blocks and K ranges.
SPLITS = [DotGemvConfig(16, 128, 1, 4), DotGemvConfig(16, 128, 4, 4), DotGemvConfig(32, 64, 3, 4, 2)]


@pytest.mark.parametrize("config", SPLITS, ids=["whole-k", "split4", "split3-uneven"])
def test_plain_and_split(kernel_device, seed, config):
    _case(kernel_device, torch.float32, 48, 544, config=config)  # 544: the last K range is short
    assert not _COUNTERS.get(kernel_device, 4).any()  # every launch leaves its counters at zero


@pytest.mark.parametrize("config", SPLITS[:2], ids=["whole-k", "split4"])
def test_fused_prologue_and_epilogues(kernel_device, seed, config):
    _case(kernel_device, torch.float32, 64, 512, norm=True, silu=True, bias=True, config=config)
    _case(kernel_device, torch.float32, 40, 512, norm=True, residual=True, config=config)
    _case(kernel_device, torch.bfloat16, 32, 256, static=True, residual=True, config=config)


def test_token_wider_than_the_statistics_tile(kernel_device, seed):
    """Inputs past token_stats_block's 4096 (down_proj's 14,336) take the prologue's two passes of
    tiles, the narrower ones its single read: both give the reference's codes."""
    cfg = DotGemvConfig(16, 512, 2, 4)
    _case(kernel_device, torch.float32, 16, 4608, norm=True, residual=True, config=cfg)
    _case(kernel_device, torch.bfloat16, 16, 4608, residual=True, config=cfg)


def test_default_config_and_bad_input(kernel_device, seed):
    _case(kernel_device, torch.bfloat16, 96, 1024, norm=True, silu=True)
    w = torch.zeros(8, 64, dtype=FP8, device=kernel_device)
    s = torch.ones(8, device=kernel_device)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        w8a8_dot_gemv(torch.zeros(1, 64, device=kernel_device), w.float(), s)
    with pytest.raises(ValueError, match="input_scale"):
        w8a8_dot_gemv(torch.zeros(1, 64, device=kernel_device), w, s, input_scale=torch.ones(2, device=kernel_device))


@pytest.mark.gpu
def test_real_shapes(cuda_device, seed):
    for n, k, silu in ((6144, 4096, False), (4096, 4096, False), (28672, 4096, True), (4096, 14336, False)):
        _case(cuda_device, torch.bfloat16, n, k, norm=not silu and k == 4096, silu=silu, residual=k == 14336)
