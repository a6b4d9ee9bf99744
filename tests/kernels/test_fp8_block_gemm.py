"""Block-wise FP8 W8A8 (kernels/fp8_block_gemm.py): the per-token-group quantizer against its torch
twin (bit for bit) and against absmax / 448; the block-scaled GEMM against float64, at tile widths
below, at and above the weight block, with and without bias; its configs and bad-input errors; the
linear that chains the two; the weight dequantizer. Runs on CUDA, and on CPU in the Triton
interpreter child; the real shapes on a GPU.

The GEMM reference: x = q * x_scale and W = w * w_scale, each scale spread over its group or block,
multiplied in float64. A group's scales are constant over it, so this is the sum of per-group
partial sums times scales that the kernel computes; an E4M3 code times an fp32 scale is exact in
float64, so the reference is exact to float64 rounding."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from ferrox.kernels import fp8_block_gemm as module
from ferrox.kernels.fp8_block_gemm import (
    BlockGemmConfig,
    choose_block_gemm_config,
    dequantize_fp8_blocks,
    fp8_block_gemm,
    fp8_block_linear,
    quantize_fp8_groups_torch,
    quantize_fp8_groups_triton,
)

from tests.kernels.kernel_refs import relative_error

FP8 = torch.float8_e4m3fn
# Interpreter-sized: 32 x 32 weight blocks, N = 72 and K = 200 off them (partial last blocks),
# 16-row token tiles, so M = 17 spans two.
BLOCK = (32, 32)
N, K = 72, 200
SMALL = BlockGemmConfig(16, 32, 4, 2, group_m=2)


def _codes(rows: int, cols: int, device) -> torch.Tensor:
    """E4M3 codes over most of the format's range (subnormals and +-448 among them)."""
    spread = 2.0 ** torch.randint(-7, 7, (rows, cols), device=device).float()
    return (torch.randn(rows, cols, device=device) * spread).clamp(-448, 448).to(FP8)


def _scales(rows: int, cols: int, device, magnitude: float) -> torch.Tensor:
    """float32 scales that differ from group to group by factors up to ~50, so a scale applied to
    the wrong group shows."""
    return (torch.rand(rows, cols, device=device) + 0.5) * magnitude * 2.0 ** torch.randint(
        0, 5, (rows, cols), device=device).float()


def _operands(m: int, n: int, k: int, block: tuple[int, int], device, bias: torch.dtype | None):
    bn, bk = block
    groups = -(-k // bk)
    xq, w = _codes(m, k, device), _codes(n, k, device)
    x_scale = _scales(m, groups, device, 2.0 ** -9)
    w_scale = _scales(-(-n // bn), groups, device, 2.0 ** -9)
    b = None if bias is None else torch.randn(n, device=device).to(bias)
    return xq, x_scale, w, w_scale, b


def _spread(scale: torch.Tensor, dim: int, size: int, length: int) -> torch.Tensor:
    """A scale per group (or block) of `size` along dim, repeated over its members."""
    return scale.repeat_interleave(size, dim=dim).narrow(dim, 0, length)


def _reference(xq, x_scale, w, w_scale, block, bias) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 (module docstring): the product, and the size of its terms (|x| @ |W|^T + |bias|),
    which the kernel's fp32 roundings are relative to."""
    bn, bk = block
    k, n = xq.shape[1], w.shape[0]
    x = xq.double() * _spread(x_scale.double(), 1, bk, k)
    weight = w.double() * _spread(_spread(w_scale.double(), 0, bn, n), 1, bk, k)
    y, terms = x @ weight.t(), x.abs() @ weight.abs().t()
    return (y, terms) if bias is None else (y + bias.double(), terms + bias.double().abs())


def _error(out: torch.Tensor, reference: tuple[torch.Tensor, torch.Tensor], block_k: int, k: int,
           fast_accum: bool = False) -> float:
    """The largest error in units of what the kernel's roundings allow (<= 1 passes):
    - fp32 output: each group's partial sum (block_k - 1 adds), its two scale products and the adds
      over the groups round once an operation, at most an ulp (2^-23) of the terms each: a bound of
      (block_k + groups + 2) ulps of the terms (typical errors are far smaller);
    - bf16 / fp16 output: that, plus the final rounding (half a step: up to 2^-8 of a bf16 value,
      2^-11 of an fp16 one; here twice that), and fp16's subnormal steps (2^-24) near zero;
    - fast_accum (a GPU's FP8 MMA summing each group in its own accumulator, ~14 bits kept): 2^-12
      of the terms more (the GPU tests; the interpreter sums in fp32)."""
    ref, terms = reference
    fp32 = (block_k + -(-k // block_k) + 2) * 2.0 ** -23 + (2.0 ** -12 if fast_accum else 0.0)
    final = {torch.float32: 0.0, torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -10}[out.dtype]
    floor = 2.0 ** -24 if out.dtype == torch.float16 else 1e-30
    allowed = final * ref.abs() + (1 + final) * fp32 * terms + floor
    return float(((out.double() - ref).abs() / allowed).max())


# ---- the activation quantizer -------------------------------------------------------------------
def _near_ties(k: int, group: int, device) -> torch.Tensor:
    """A float32 row whose group g has the absmax a_g, so its scale s_g = a_g / 448, and whose other
    values are fl(t * s_g) for t halfway between two E4M3 codes: x / s_g lands on or a hair from a
    rounding tie, where a division rounded otherwise (x times 1 / s, as torch on CUDA divides by a
    Python number) changes about one code in ten."""
    low = torch.randint(8, 125, (k,), dtype=torch.uint8, device=device)  # normal codes below 448
    mid = (low.view(FP8).float() + (low + 1).view(FP8).float()) / 2
    sign = torch.randint(0, 2, (k,), device=device).float() * 2 - 1
    a = torch.rand(-(-k // group), device=device) + 1
    x = mid * sign * (a / a.new_tensor(448.0)).repeat_interleave(group)[:k]
    x[::group] = a
    return x


def _awkward_rows(k: int, group: int, device, dtype: torch.dtype) -> torch.Tensor:
    """Rows [7, k] in dtype: normal, small, all zero (a padded batch row), huge (fp16: its largest
    value, every element), a few outliers per group, exact powers of two, near rounding ties; all
    finite in dtype."""
    fp16 = dtype == torch.float16
    x = torch.randn(7, k, device=device)
    x[1] *= 1e-3
    x[2] = 0
    x[3] = torch.randn(k, device=device).sign() * 65504 if fp16 else x[3] * 1e30
    x[4, ::7] *= 1e3 if fp16 else 1e4
    x[5] = 2.0 ** torch.randint(-20, 15 if fp16 else 40, (k,), device=device).float()
    x[6] = _near_ties(k, group, device)
    return x.to(dtype)


@pytest.mark.parametrize("group", [16, 32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_quantizer_matches_torch_to_the_bit(kernel_device, seed, dtype, group):
    """K = 200 is not a multiple of the group (a short last group). The Triton codes and scales are
    the torch twin's, bit for bit; each scale is its group's absmax / 448 correctly rounded; each
    nonzero group's largest code is +-448 and no code exceeds it. Both divisions are correctly
    rounded on both sides (the kernel's div_rn, torch tensor by tensor), or the near-tie row differs."""
    x = _awkward_rows(K, group, kernel_device, dtype)
    q, scale = quantize_fp8_groups_triton(x, group)
    ref_q, ref_scale = quantize_fp8_groups_torch(x, group)
    groups = -(-K // group)
    assert q.dtype == FP8 and q.shape == (7, K) and scale.dtype == torch.float32 and scale.shape == (7, groups)
    assert torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8))
    assert torch.equal(scale, ref_scale)

    padded = torch.zeros(7, groups * group, dtype=torch.float64, device=kernel_device)
    padded[:, :K] = x.double()
    amax = padded.view(7, groups, group).abs().amax(dim=2)
    # An fp32 quotient correctly rounded is the float64 quotient rounded to fp32.
    assert torch.equal(scale, (amax.clamp(min=float(torch.tensor(1e-12))) / 448).float())
    codes = torch.zeros(7, groups * group, device=kernel_device)
    codes[:, :K] = q.float()
    largest = codes.view(7, groups, group).abs().amax(dim=2)
    assert torch.equal(largest, torch.where(amax > 0, 448.0, 0.0).float())
    assert (q[2].float() == 0).all() and 0 < float(scale[2, 0]) < 1e-12


def test_quantizer_takes_no_rows_and_strided_rows(kernel_device, seed):
    q, scale = quantize_fp8_groups_triton(torch.empty(0, 64, device=kernel_device), 32)
    assert q.shape == (0, 64) and scale.shape == (0, 2)
    wide = torch.randn(4, 2 * K, device=kernel_device)
    q, scale = quantize_fp8_groups_triton(wide[:, ::2], 32)  # copied to unit stride first
    ref_q, ref_scale = quantize_fp8_groups_torch(wide[:, ::2], 32)
    assert torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8)) and torch.equal(scale, ref_scale)
    q, scale = quantize_fp8_groups_triton(wide[:, :K], 32)  # a row stride of its own
    ref_q, ref_scale = quantize_fp8_groups_torch(wide[:, :K], 32)
    assert torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8)) and torch.equal(scale, ref_scale)


# ---- the GEMM ----------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("m", [1, 3, 17])
def test_gemm_against_float64(kernel_device, seed, m, bias, dtype):
    xq, x_scale, w, w_scale, b = _operands(m, N, K, BLOCK, kernel_device, dtype if bias else None)
    out = fp8_block_gemm(xq, x_scale, w, w_scale, BLOCK, b, dtype, config=SMALL)
    assert out.shape == (m, N) and out.dtype == dtype
    assert _error(out, _reference(xq, x_scale, w, w_scale, BLOCK, b), BLOCK[1], K) <= 1


@pytest.mark.parametrize(("block", "block_n"), [((32, 32), 16), ((32, 32), 64), ((16, 32), 64), ((64, 16), 32)],
                         ids=["tile-in-block", "tile-over-2-blocks", "tile-over-4-blocks", "k16-tile-in-block"])
def test_gemm_tile_width_against_weight_blocks(kernel_device, seed, block, block_n):
    """Output tiles narrower and wider than a weight block (the block-row index is per output row);
    16-wide groups, below the FP8 MMA's K, through the fp16 path."""
    xq, x_scale, w, w_scale, b = _operands(17, N, K, block, kernel_device, torch.float32)
    out = fp8_block_gemm(xq, x_scale, w, w_scale, block, b, torch.float32,
                         config=BlockGemmConfig(16, block_n, 4, 2, group_m=2))
    assert _error(out, _reference(xq, x_scale, w, w_scale, block, b), block[1], K) <= 1


def test_gemm_fails_against_wrong_scales(kernel_device, seed):
    """The check can fail: the same output against references whose scales are misplaced -- one
    activation scale per row (group 0's), weight blocks shifted by one block row, weight blocks of
    twice the rows -- is off by hundreds of the allowed errors."""
    xq, x_scale, w, w_scale, b = _operands(17, N, K, BLOCK, kernel_device, None)
    out = fp8_block_gemm(xq, x_scale, w, w_scale, BLOCK, None, torch.float32, config=SMALL)
    assert _error(out, _reference(xq, x_scale, w, w_scale, BLOCK, None), BLOCK[1], K) <= 1
    wrong = [
        _reference(xq, x_scale[:, :1].expand_as(x_scale), w, w_scale, BLOCK, None),
        _reference(xq, x_scale, w, w_scale.roll(1, dims=0), BLOCK, None),
        _reference(xq, x_scale, w, w_scale[::2], (2 * BLOCK[0], BLOCK[1]), None),
    ]
    for reference in wrong:
        assert _error(out, reference, BLOCK[1], K) > 100


def test_gemm_default_configs(kernel_device, seed):
    """config=None at a decode batch, a mid-size one and a large one (each its own tile shape), and
    no rows at all."""
    block = (16, 32)
    for m in (2, 40, 130):
        xq, x_scale, w, w_scale, b = _operands(m, 48, 96, block, kernel_device, torch.float32)
        out = fp8_block_gemm(xq, x_scale, w, w_scale, block, b, torch.float32)
        assert _error(out, _reference(xq, x_scale, w, w_scale, block, b), block[1], 96) <= 1, m
    empty = fp8_block_gemm(xq[:0], x_scale[:0], w, w_scale, block, None, torch.float32)
    assert empty.shape == (0, 48)


def test_config_choice():
    """By batch size, the largest tile that still launches ~one program per SM (of 132); fewer
    stages for wide blocks."""
    decode = {n: choose_block_gemm_config(1, n, 4096, (128, 128)) for n in (4096, 6144, 28672)}
    assert {n: (c.block_m, c.block_n) for n, c in decode.items()} == {4096: (16, 32), 6144: (16, 32),
                                                                      28672: (16, 128)}
    assert choose_block_gemm_config(16, 4096, 14336, (128, 128)).block_m == 16
    for m in (65, 256, 2048):  # the H200 sweep's tile (the module's table)
        big = choose_block_gemm_config(m, 4096, 4096, (128, 128))
        assert (big.block_m, big.block_n, big.num_warps) == (64, 128, 4)
    mid = {n: choose_block_gemm_config(64, n, 4096, (128, 128)) for n in (4096, 28672)}
    assert {n: (c.block_m, c.block_n) for n, c in mid.items()} == {4096: (128, 64), 28672: (64, 128)}
    assert choose_block_gemm_config(2048, 4096, 4096, (128, 1024)).num_stages == 1
    for m in (1, 16, 17, 64, 65, 2048):
        cfg = choose_block_gemm_config(m, 4096, 4096, (128, 128))
        assert cfg.block_m >= 16 and cfg.block_n >= 16 and cfg.num_stages >= 1


def test_kernels_refuse_bad_input(kernel_device):
    w = torch.zeros(64, 96, device=kernel_device).to(FP8)
    ws = torch.ones(2, 3, device=kernel_device)
    xq = torch.zeros(2, 96, device=kernel_device).to(FP8)
    xs = torch.ones(2, 3, device=kernel_device)
    block = (32, 32)
    cases = {
        "weight must": lambda: fp8_block_gemm(xq, xs, w.float(), ws, block),
        "xq must": lambda: fp8_block_gemm(xq[:, :64], xs, w, ws, block),
        "x_scale must": lambda: fp8_block_gemm(xq, xs[:, :2], w, ws, block),
        "w_scale must": lambda: fp8_block_gemm(xq, xs, w, ws.t().contiguous(), block),
        "bias must": lambda: fp8_block_gemm(xq, xs, w, ws, block, torch.zeros(63, device=kernel_device)),
        "out_dtype must": lambda: fp8_block_gemm(xq, xs, w, ws, block, out_dtype=torch.int32),
        "block_n must": lambda: fp8_block_gemm(xq, xs, w, ws, (48, 32)),
        "block_k must": lambda: fp8_block_gemm(xq, xs, w, ws, (32, 8)),
        "group must": lambda: quantize_fp8_groups_triton(xq.float(), 24),
        "x must": lambda: quantize_fp8_groups_triton(xq, 32),
        "x must be": lambda: fp8_block_linear(torch.zeros(2, 95, device=kernel_device), w, ws, block),
    }
    for message, call in cases.items():
        with pytest.raises(ValueError, match=message):
            call()


# ---- the linear and the dequantizer --------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_linear_chains_quantizer_and_gemm(kernel_device, seed, dtype):
    """fp8_block_linear on [2, 3, K]: the Triton quantizer's codes into the GEMM, output in x's dtype;
    against float64 on the torch quantizer's codes (the same bits)."""
    _, _, w, w_scale, b = _operands(6, N, K, BLOCK, kernel_device, dtype)
    x = torch.randn(2, 3, K, device=kernel_device).to(dtype)
    y = fp8_block_linear(x, w, w_scale, BLOCK, b)
    assert y.shape == (2, 3, N) and y.dtype == dtype
    xq, x_scale = quantize_fp8_groups_torch(x.reshape(6, K), BLOCK[1])
    assert _error(y.reshape(6, N), _reference(xq, x_scale, w, w_scale, BLOCK, b), BLOCK[1], K) <= 1


def test_dequantize_fp8_blocks(monkeypatch, seed):
    """Element by element weight * its block's scale; in bands of block rows (a short last band)
    when the weight is large: here made small to take several bands."""
    block = (16, 32)
    w = _codes(72, 200, "cpu")
    w_scale = _scales(5, 7, "cpu", 1e-3)
    n, k = torch.arange(72)[:, None], torch.arange(200)[None, :]
    expected = w.float() * w_scale[n // 16, k // 32]
    assert torch.equal(dequantize_fp8_blocks(w, w_scale, block), expected)
    monkeypatch.setattr(module, "_DEQUANTIZE_BAND", 2 * 16 * 200)
    assert torch.equal(dequantize_fp8_blocks(w, w_scale, block, torch.bfloat16), expected.to(torch.bfloat16))
    with pytest.raises(ValueError, match="w_scale must"):
        dequantize_fp8_blocks(w, w_scale[:4], block)


# ---- GPU, real shapes ---------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize(("n", "k"), [(4096, 4096), (6144, 4096), (28672, 4096), (4096, 14336)])
def test_real_shapes(cuda_device, seed, n, k):
    """128 x 128 blocks, the default configs, bf16 out with a bias: each batch size's tile against
    float64 on the same codes, and the Triton quantizer against torch on CUDA, to the bit."""
    block = (128, 128)
    _, _, w, w_scale, b = _operands(1, n, k, block, cuda_device, torch.bfloat16)
    for m in (1, 16, 256, 2048):
        x = torch.randn(m, k, device=cuda_device, dtype=torch.bfloat16)
        xq, x_scale = quantize_fp8_groups_triton(x, block[1])
        ref_q, ref_scale = quantize_fp8_groups_torch(x, block[1])
        assert torch.equal(xq.view(torch.uint8), ref_q.view(torch.uint8)) and torch.equal(x_scale, ref_scale), m
        out = fp8_block_gemm(xq, x_scale, w, w_scale, block, b)
        assert _error(out, _reference(xq, x_scale, w, w_scale, block, b), block[1], k, fast_accum=True) <= 1, m
        assert torch.equal(fp8_block_linear(x, w, w_scale, block, b), out), m


@pytest.mark.gpu
def test_real_shapes_sum_in_fp32(cuda_device, seed):
    """fp32 output, where the FP8 MMA's partial sums show: with fast_accum off, within fp32 rounding
    of float64 with the 16-row tile and the warpgroup-MMA tiles (64 and 128 rows); with it (the
    default), within the MMA accumulator's bound."""
    block, n, k = (128, 128), 4096, 4096
    for m in (16, 256, 2048):
        xq, x_scale, w, w_scale, _ = _operands(m, n, k, block, cuda_device, None)
        reference = _reference(xq, x_scale, w, w_scale, block, None)
        cfg = choose_block_gemm_config(m, n, k, block)
        exact = fp8_block_gemm(xq, x_scale, w, w_scale, block, None, torch.float32,
                               config=dataclasses.replace(cfg, fast_accum=False))
        assert _error(exact, reference, block[1], k) <= 1, m
        fast = fp8_block_gemm(xq, x_scale, w, w_scale, block, None, torch.float32, config=cfg)
        assert relative_error(fast, reference[0]) < 1e-3, m  # (the MMA's narrow sums, promoted every group)


@pytest.mark.gpu
def test_quantizer_wide_rows(cuda_device, seed):
    """A batch of 14336-wide rows with outliers: the same bits as torch on CUDA and on the CPU."""
    x = torch.randn(300, 14336, device=cuda_device, dtype=torch.bfloat16)
    x[7] *= 1000
    x[9, ::5] *= 50
    q, scale = quantize_fp8_groups_triton(x, 128)
    for ref_q, ref_scale in (quantize_fp8_groups_torch(x, 128), quantize_fp8_groups_torch(x.cpu(), 128)):
        assert torch.equal(q.view(torch.uint8).cpu(), ref_q.view(torch.uint8).cpu())
        assert torch.equal(scale.cpu(), ref_scale.cpu())
