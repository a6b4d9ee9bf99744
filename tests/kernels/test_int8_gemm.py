"""int8 W8A8 in the kernels: the Triton int8 GEMM and its epilogue (kernels/int8_gemm.py), the
int8 row quantizer (fp8_linear.py's, int8 variant) against torch's rounding, int8 weights through the
fp8 weight-only kernels (gemv.py, fp8_weight_gemm.py), and the CUDA paths of the runner
(layers/quant/int8_linear.py) against its CPU arithmetic.
Runs on CUDA, and on CPU in the Triton interpreter child; the real shapes on a GPU.

References are exact: int8 products summed in float64 (every sum of int8 x int8 products below 2^53
is exact there), times the scales."""

from __future__ import annotations

import pytest
import torch
from ferrox.kernels.fp8_weight_gemm import GemmConfig, fp8_weight_gemm, fp8_weight_linear
from ferrox.kernels.gemv import gemv
from ferrox.kernels.int8_gemm import Int8GemmConfig, int8_gemm
from ferrox.layers.quant.int8_linear import (
    Int8Linear,
    quantize_int8_torch,
    quantize_int8_triton,
)

from tests.kernels.conftest import INTERPRETED
from tests.kernels.kernel_refs import relative_error

# Interpreter-sized tiles: several token and row tiles, K and N off them.
SMALL = Int8GemmConfig(16, 32, 32, 4, 2, group_m=2)


@pytest.fixture
def ints_widen_like_the_gpu(monkeypatch):
    """Triton's interpreter (3.9) converts an int to bf16 with numpy's integer cast onto the bf16's
    uint16 bits (3 becomes a denormal); the GPU converts the value. Here ints reach bf16 through
    float32 (exact for int8), as the GPU rounds them."""
    if not INTERPRETED:
        return
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    original = builder.create_si_to_fp

    def si_to_fp(self, src, dst_type):
        if dst_type.scalar == tl.bfloat16:
            return self.cast_impl(original(self, src, tl.float32), dst_type)
        return original(self, src, dst_type)

    monkeypatch.setattr(builder, "create_si_to_fp", si_to_fp)


def _operands(m: int, n: int, k: int, device, dtype: torch.dtype, bias: bool):
    xq = torch.randint(-128, 128, (m, k), dtype=torch.int8, device=device)
    w = torch.randint(-128, 128, (n, k), dtype=torch.int8, device=device)
    x_scale = torch.rand(m, 1, device=device) * 0.02 + 1e-3
    w_scale = torch.rand(n, device=device) * 1e-3 + 1e-4
    b = torch.randn(n, device=device).to(dtype) if bias else None
    return xq, x_scale, w, w_scale, b


def _reference(xq, x_scale, w, w_scale, b) -> tuple[torch.Tensor, torch.Tensor]:
    """float64: the exact int sums, times both scales, plus the bias; and the size of the terms
    (|product| + |bias|), which the fp32 epilogue's rounding is relative to."""
    acc = xq.double() @ w.double().t()
    y = acc * x_scale.double().reshape(-1, 1) * w_scale.double()[None, :]
    return (y, y.abs()) if b is None else (y + b.double(), y.abs() + b.double().abs())


def _assert_close(out: torch.Tensor, reference: tuple[torch.Tensor, torch.Tensor]) -> None:
    """Within the fp32 epilogue's rounding (a few fp32 ulps of the terms), and for 16-bit outputs
    their final rounding (half a step, 2^-9 of bf16's value; fp16's subnormals below 6e-5 are
    coarser, so sums that cancel to almost nothing are measured against 1/1000 of the largest)."""
    ref, terms = reference
    tol = 1e-6 if out.dtype == torch.float32 else 2.0 ** -8
    err = (out.double() - ref).abs() / terms.clamp_min(1e-3 * float(terms.max()))
    assert float(err.max()) <= tol, float(err.max())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("m", [1, 3, 16])
def test_int8_gemm_is_exact_before_its_epilogue(kernel_device, seed, m, bias, dtype):
    xq, x_scale, w, w_scale, b = _operands(m, 72, 200, kernel_device, dtype, bias)
    out = int8_gemm(xq, x_scale, w, w_scale, b, dtype, config=SMALL)
    assert out.shape == (m, 72) and out.dtype == dtype
    _assert_close(out, _reference(xq, x_scale, w, w_scale, b))


def test_int8_gemm_default_configs(kernel_device, seed):
    for m in (2, 40, 130):  # the decode tile, the mid-size one, the large one
        xq, x_scale, w, w_scale, b = _operands(m, 48, 264, kernel_device, torch.float32, True)
        _assert_close(int8_gemm(xq, x_scale, w, w_scale, b, torch.float32), _reference(xq, x_scale, w, w_scale, b))
    empty = int8_gemm(xq[:0], x_scale[:0], w, w_scale, None, torch.float32)
    assert empty.shape == (0, 48)


def test_kernels_refuse_bad_input(kernel_device):
    w = torch.zeros(8, 32, dtype=torch.int8, device=kernel_device)
    s = torch.ones(8, device=kernel_device)
    xq = torch.zeros(2, 32, dtype=torch.int8, device=kernel_device)
    xs = torch.ones(2, 1, device=kernel_device)
    with pytest.raises(ValueError, match="weight must"):
        int8_gemm(xq, xs, w.float(), s)
    with pytest.raises(ValueError, match="xq must"):
        int8_gemm(xq.float(), xs, w, s)
    with pytest.raises(ValueError, match="x_scale"):
        int8_gemm(xq, xs[:1], w, s)
    with pytest.raises(ValueError, match="weight_scale"):
        int8_gemm(xq, xs, w, s.double())
    with pytest.raises(ValueError, match="bias"):
        int8_gemm(xq, xs, w, s, torch.zeros(9, device=kernel_device))


# ---- the activation quantizer -------------------------------------------------------------------
def test_int8_row_quantizer_rounds_as_torch(kernel_device, seed):
    """Per token, per tensor (a given scale) and through exact halves: the Triton quantizer's codes and
    scales are torch's (x / scale rounded half to even, clamped to [-128, 127]); an all-zero row gets
    the floor scale."""
    x = torch.randn(5, 300) * torch.tensor([0.1, 1, 10, 100, 0])[:, None]
    for dtype in (torch.float32, torch.bfloat16):
        for scale in (None, torch.tensor([0.05])):
            q, s = quantize_int8_triton(x.to(kernel_device, dtype), None if scale is None else scale.to(kernel_device))
            # On the CPU: torch's CUDA division by a scalar multiplies by its reciprocal (an ulp off).
            q_ref, s_ref = quantize_int8_torch(x.to(dtype), scale)
            assert q.dtype == torch.int8 and s.shape == (5, 1)
            assert torch.equal(q.cpu(), q_ref) and torch.equal(s.cpu(), s_ref)
    # Exact halves (k / 2 for k = -300..300) with the scale 1: ties go to even, the ends clamp.
    halves = (torch.arange(-300, 301, device=kernel_device, dtype=torch.float32) / 2).reshape(1, -1)
    q, _ = quantize_int8_triton(halves, torch.ones(1, device=kernel_device))
    expected = torch.round(halves).clamp(-128, 127)  # torch.round: half to even
    assert torch.equal(q.float(), expected)
    assert q[0, 300 + 5].item() == 2 and q[0, 300 + 7].item() == 4 and q[0, 300 - 5].item() == -2


# ---- int8 weights in the fp8 weight-only kernels ------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weight_only_kernels_widen_int8(kernel_device, seed, ints_widen_like_the_gpu, dtype):
    """The one-token GEMV and the weight-only GEMM widen int8 weights exactly (as fp8 ones): against
    float64 on the dequantized weight."""
    w = torch.randint(-128, 128, (40, 200), dtype=torch.int8, device=kernel_device)
    s = torch.rand(40, device=kernel_device) * 1e-3 + 1e-4
    w_ref = w.double() * s.double()[:, None]
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    x = torch.randn(1, 200, device=kernel_device).to(dtype)
    assert relative_error(gemv(x, w, None, weight_scale=s), x.double() @ w_ref.t()) < tol
    x = torch.randn(5, 200, device=kernel_device).to(dtype)
    b = torch.randn(40, device=kernel_device).to(dtype)
    out = fp8_weight_gemm(x, w, s, b, config=GemmConfig(16, 32, 64, 4, 2, group_m=2))
    assert relative_error(out, x.double() @ w_ref.t() + b.double()) < tol


# ---- the runner's CUDA paths against its CPU arithmetic ------------------------------------------
def _runner(n: int, k: int, activations: str, device) -> Int8Linear:
    w = torch.randint(-127, 128, (n, k), dtype=torch.int8)
    s = torch.rand(n) * 1e-3 + 1e-4
    input_scale = torch.tensor([0.02]) if activations == "static" else None
    return Int8Linear(w.to(device), s.to(device), activations=activations,
                      input_scale=None if input_scale is None else input_scale.to(device))


@pytest.mark.parametrize("activations", ["dynamic-token", "dynamic-tensor", "static"])
def test_runner_gpu_paths_match_its_cpu_arithmetic(kernel_device, seed, activations):
    """The W8A8 path the GPU runs (the Triton quantizer, then the Triton int8 GEMM) against the CPU
    runner's dequantized arithmetic on the same weight; in the interpreter on CPU tensors."""
    cpu = _runner(48, 96, activations, "cpu")
    on_device = Int8Linear(cpu.weight.to(kernel_device), cpu.weight_scale.to(kernel_device), activations=activations,
                           input_scale=None if cpu.input_scale is None else cpu.input_scale.to(kernel_device))
    bias = torch.randn(48)
    for m in (2, 20):
        x = torch.randn(m, 96) * 2
        got = on_device._w8a8_cuda(x.to(kernel_device), bias.to(kernel_device))
        assert relative_error(got.cpu(), cpu(x, bias)) < 1e-6, m


# ---- GPU, real shapes ---------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_real_shapes(cuda_device, seed, dtype):
    n = k = 4096
    w = torch.randint(-127, 128, (n, k), dtype=torch.int8, device=cuda_device)
    w_scale = torch.rand(n, device=cuda_device) * 1e-3 + 1e-4
    bias = torch.randn(n, device=cuda_device).to(dtype)
    layer = Int8Linear(w, w_scale, activations="dynamic-token")
    for m in (*range(1, 65), 256):
        x = torch.randn(m, k, device=cuda_device).to(dtype)
        # Quantized on the CPU, where torch divides correctly rounded as the kernel does.
        xq, x_scale = (t.to(cuda_device) for t in quantize_int8_torch(x.cpu()))
        for b in (None, bias):
            _assert_close(layer(x, b), _reference(xq, x_scale, w, w_scale, b))
        _assert_close(int8_gemm(xq, x_scale, w, w_scale, bias, dtype), _reference(xq, x_scale, w, w_scale, bias))
    x = torch.randn(300, k, device=cuda_device).to(dtype)
    weight_only = Int8Linear(w, w_scale, activations="weight-only")
    w_ref = w.double() * w_scale.double()[:, None]
    for rows in (x[:1], x[:7], x[:64], x):  # the GEMV, the GEMM, dequantize + cuBLAS
        assert relative_error(weight_only(rows, bias), rows.double() @ w_ref.t() + bias.double()) < 2e-2
    assert relative_error(fp8_weight_linear(x, w, w_scale), x.double() @ w_ref.t()) < 2e-2
