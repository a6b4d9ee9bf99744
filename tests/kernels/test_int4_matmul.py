"""int4 weight-only kernels (kernels/int4_matmul.py) and their runner (layers/quant/int4_pack.py)
against x @ W.T with W dequantized in float64: the decode GEMV, the prefill GEMM, the dequantize
kernel, and the runner's path choice with act-order. Tiny shapes on CPU under the Triton
interpreter (test_interpreter.py); Llama-3.1-8B shapes on a GPU."""

from __future__ import annotations

import pytest
import torch
from ferrox.kernels import int4_matmul as km
from ferrox.kernels.int4_gemv_cuda import pack_mma
from ferrox.layers.quant.int4_pack import Int4Linear, dequantize_codes, pack_interleaved, unpack_nibbles

from tests.kernels.kernel_refs import relative_error

TOLERANCE = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}


def _weight(n: int, k: int, group: int, device, *, gen: torch.Generator | None = None, mma: bool = False,
            scale_dtype: torch.dtype = torch.float16):
    """(Int4Weights, float64 W [n, k]): random codes, zero points 0..16, scales ~0.01 (fp16). mma: with
    the tensor-core kernel's stream too (kernels/int4_gemv_cuda.py), so decode products on a GPU take
    that kernel."""
    group = k if group == -1 else group
    groups = -(-k // group)
    codes = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=gen)
    scales = (0.005 + 0.01 * torch.rand(groups, n, generator=gen)).to(scale_dtype)
    zeros = torch.randint(0, 17, (groups, n), dtype=torch.uint8, generator=gen)
    w = dequantize_codes(codes, scales, zeros, group).double()
    t = km.interleave_words(k, group)
    packed = pack_interleaved(codes, t)
    weights = km.Int4Weights(packed.to(device), scales.t().contiguous().to(device),
                             zeros.t().contiguous().to(device), min(group, k), t,
                             pack_mma(codes, scales.t(), zeros.t(), group).to(device) if mma else None)
    return weights, w.to(device)


def _ref(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    y = x.double() @ w.t()
    return y if bias is None else y + bias.double()


def test_packed_layout():
    """Word i of block b holds k = 8T b + T j + i in nibble j (the layout the kernels read)."""
    k, t = 64, 4
    codes = (torch.arange(k) % 16).to(torch.uint8)[None, :].repeat(2, 1)
    codes[1] = torch.randint(0, 16, (k,), dtype=torch.uint8)
    packed = pack_interleaved(codes, t)
    nibbles = unpack_nibbles(packed, 1).view(2, k // (8 * t), t, 8)  # [n, block, word, nibble]
    for b in range(k // (8 * t)):
        for i in range(t):
            for j in range(8):
                assert nibbles[1, b, i, j] == codes[1, 8 * t * b + t * j + i]


def test_interleave_choice():
    assert km.interleave_words(4096, 128) == 16
    assert km.interleave_words(4096, 4096) == 64  # one group
    assert km.interleave_words(14336, 64) == 8
    with pytest.raises(ValueError, match="divisible by 32"):
        km.interleave_words(4096, 16)
    with pytest.raises(ValueError, match="divisible by 32"):
        km.interleave_words(80, 80)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_gemv_tiny(kernel_device, seed, dtype):
    cases = [  # n, k, group, m, bias, config
        (24, 256, 32, 1, False, None),
        (37, 512, 128, 2, True, None),  # rows not a multiple of the row block
        (16, 2560, 128, 1, False, km.GemvConfig(block_n=4, num_warps=2)),  # K tile of 2048: a tail
        (12, 320, -1, 1, True, km.GemvConfig(block_n=2, num_warps=1)),  # one group
        (8, 192, 64, 3, False, None),
        (16, 96, 64, 1, True, None),  # K not a multiple of the group: a short last group
    ]
    for n, k, group, m, has_bias, config in cases:
        w, ref_w = _weight(n, k, group, kernel_device)
        x = torch.randn(m, k, device=kernel_device).to(dtype)
        bias = torch.randn(n, device=kernel_device).to(dtype) if has_bias else None
        y = km.int4_gemv(x, w, bias, config)
        assert y.shape == (m, n) and y.dtype == dtype
        assert relative_error(y, _ref(x, ref_w, bias)) < TOLERANCE[dtype], (n, k, group, m)


@pytest.mark.parametrize("swap_ab", [False, True], ids=["x-w", "swapped"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_gemm_tiny(kernel_device, seed, dtype, swap_ab):
    cfg = km.GemmConfig(block_m=16, block_n=16, num_warps=4, num_stages=2, group_m=2, swap_ab=swap_ab)
    for n, k, group, m, has_bias in [(40, 256, 128, 19, True), (24, 512, -1, 5, False)]:
        w, ref_w = _weight(n, k, group, kernel_device)
        x = torch.randn(m, k, device=kernel_device).to(dtype)
        bias = torch.randn(n, device=kernel_device).to(dtype) if has_bias else None
        y = km.int4_gemm(x, w, bias, cfg)
        assert relative_error(y, _ref(x, ref_w, bias)) < TOLERANCE[dtype], (n, k, group, m)
    w, _ = _weight(8, 256, 32, kernel_device)  # interleave 4: no plane is wide enough for tl.dot
    with pytest.raises(ValueError, match="interleave"):
        km.int4_gemm(torch.randn(20, 256, device=kernel_device), w)


def test_dequantize_is_exact(kernel_device, seed):
    # Programs of one block or several (a run of blocks per row, groups changing inside it), rows
    # past N masked, a block count the run length must shrink to divide (384: three blocks).
    for n, k, group in [(20, 256, 32), (8, 384, 128), (4, 256, -1), (8, 96, 64), (20, 1024, 128)]:
        w, ref_w = _weight(n, k, group, kernel_device)
        for block_n, block_words in [(16, 64), (8, 16), (4, 128)]:
            out = km.int4_dequantize(w, torch.float32, block_n=block_n, block_words=block_words)
            torch.testing.assert_close(out, ref_w.float(), rtol=0, atol=0, msg=f"{(n, k, group, block_n, block_words)}")


def test_runner_paths_with_act_order(kernel_device, seed, monkeypatch):
    """The runner on the kernels (permuting x into act-order) equals the runner that dequantizes once
    (checkpoint column order), through each path: GEMV, GEMM and dequantize + F.linear."""
    monkeypatch.setattr(km, "DEQUANT_MIN_M", 12)
    n, k, group = 24, 256, 128
    codes = torch.randint(0, 16, (n, k), dtype=torch.uint8)
    scales = (0.005 + 0.01 * torch.rand(k // group, n)).to(torch.float16)
    zeros = torch.randint(0, 17, (k // group, n), dtype=torch.uint8)
    perm = torch.randperm(k)
    reference = Int4Linear(codes, scales, zeros, group, perm, dtype=torch.float32, kernels=False)
    runner = Int4Linear(codes.to(kernel_device), scales.to(kernel_device), zeros.to(kernel_device), group,
                        perm.to(kernel_device), dtype=torch.float32, kernels=True)
    bias = torch.randn(n)
    for m in (1, 6, 14):  # GEMV, GEMM, dequantize
        x = torch.randn(m, k)
        want = reference(x, bias)
        got = runner(x.to(kernel_device), bias.to(kernel_device)).cpu()
        assert relative_error(got, want) < 1e-5, m


# ---- GPU, Llama-3.1-8B shapes -----------------------------------------------------------------------
SHAPES_8B = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("proj", list(SHAPES_8B))
def test_paths_at_llama_8b_shapes(cuda_device, seed, dtype, proj):
    n, k = SHAPES_8B[proj]
    w, ref_w = _weight(n, k, 128, cuda_device)
    bias = torch.randn(n, device=cuda_device).to(dtype)
    for m in (1, 3, 16, 200, 1500):  # GEMV, GEMV, GEMM, swapped GEMM, dequantize + cuBLAS
        x = torch.randn(m, k, device=cuda_device).to(dtype)
        y = km.int4_linear(x, w, bias)
        assert relative_error(y, _ref(x, ref_w, bias)) < TOLERANCE[dtype], (proj, m)
    w, ref_w = _weight(n, k, -1, cuda_device)  # one group per column
    x = torch.randn(1, k, device=cuda_device).to(dtype)
    assert relative_error(km.int4_gemv(x, w), _ref(x, ref_w, None)) < TOLERANCE[dtype]


@pytest.mark.gpu
def test_act_order_runner_on_gpu(cuda_device, seed):
    n, k, group = 4096, 4096, 128
    codes = torch.randint(0, 16, (n, k), dtype=torch.uint8)
    scales = (0.005 + 0.01 * torch.rand(k // group, n)).to(torch.float16)
    zeros = torch.randint(0, 17, (k // group, n), dtype=torch.uint8)
    perm = torch.randperm(k)
    reference = Int4Linear(codes, scales, zeros, group, perm, dtype=torch.float32, kernels=False)
    runner = Int4Linear(codes.to(cuda_device), scales.to(cuda_device), zeros.to(cuda_device), group,
                        perm.to(cuda_device), dtype=torch.bfloat16, kernels=True)
    for m in (1, 64, 2048):
        x = torch.randn(m, k)
        got = runner(x.to(cuda_device, torch.bfloat16)).float().cpu()
        assert relative_error(got, reference(x.bfloat16().float())) < 2e-2, m
