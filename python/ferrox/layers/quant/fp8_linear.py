"""The FP8 linear runner: float8 E4M3 weights with one float32 scale per output row (layers/quant/fp8.py
builds them, from a float checkpoint or an FP8 one).

How a layer multiplies (`Fp8Linear`), W8A8 at every row count as vLLM's FP8 layers (activations
quantized to fp8 per token, dynamic: each row's absmax maps to 448, or with the checkpoint's input
scale, static), except for weight-only checkpoints (W8A16), whose activations stay in the model dtype:
- One row (a batch-1 decode step): on CUDA the tensor-core split-K product (kernels/w8a8_dot_gemv.py)
  quantizes the token inside the kernel and streams each weight byte once, the scales applied in
  its epilogue; the fused decode path (attention/fused_decode.py) runs whole decoder layers so,
  reading `layer.weight` (fp8), `layer.weight_scale` and `one_token_w8a8()`. Weight-only layers
  take the CUDA-core GEMV (kernels/gemv.py), which widens each weight in registers.
- More rows: the activations quantized in one Triton launch (kernels/row_quant.py), then `torch._scaled_mm` (cuBLASLt FP8
  with row-wise scales; the bias is added after it): Hopper's FP8 tensor cores run at twice the
  bf16 rate for prefill and large batches. Weight-only layers take kernels/fp8_weight_gemm.py (each
  weight tile widened in registers for tl.dot; dequantize + cuBLAS for prefill chunks).
- CPU (tests, development): the same arithmetic on a dequantized copy of the weight, activations
  rounded through fp8 in place; for correctness, not speed or memory.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ferrox.kernels import dense_gemv_cuda
from ferrox.kernels.fp8_weight_gemm import fp8_weight_linear
from ferrox.kernels.gemv import gemv
from ferrox.kernels.row_quant import _MIN_AMAX, FP8_DTYPE, FP8_MAX, quantize_activations_triton
from ferrox.kernels.w8a8_dot_gemv import w8a8_dot_gemv

# How activations enter the matmul: quantized per token at run time, per tensor at run time, with
# the checkpoint's calibrated scale, or not at all (weight-only FP8).
ACTIVATIONS = ("dynamic-token", "dynamic-tensor", "static", "weight-only")
# Hopper's FP8 GEMMs in vLLM accumulate without periodic promotion too (its CUTLASS "FastAccum"
# kernels); the accuracy benchmark (benches/bench_quant_accuracy.py) measures the result.
_FAST_ACCUM = True


# ---- quantizing ---------------------------------------------------------------------------------
def quantize_per_row(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 [out, in], float32 [out]) with weight ~= q * scale[:, None]: each row's absmax maps to
    448. Blocks of rows at a time, so the float32 temporaries stay small next to an 8B model."""
    q = torch.empty(weight.shape, dtype=FP8_DTYPE, device=weight.device)
    scale = torch.empty(weight.shape[0], dtype=torch.float32, device=weight.device)
    step = max(1, (1 << 26) // max(1, weight.shape[1]))  # 64M elements: 256 MB of float32
    for start in range(0, weight.shape[0], step):
        rows = weight[start:start + step].float()
        s = rows.abs().amax(dim=1).clamp(min=_MIN_AMAX) / FP8_MAX
        q[start:start + step] = (rows / s[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
        scale[start:start + step] = s
    return q, scale


def quantize_activations_torch(x: torch.Tensor, scale: torch.Tensor | None = None
                               ) -> tuple[torch.Tensor, torch.Tensor]:
    """The same as quantize_activations_triton in torch ops (the CPU path)."""
    xf = x.float()
    if scale is None:
        row_scale = xf.abs().amax(dim=1, keepdim=True).clamp(min=_MIN_AMAX) / FP8_MAX
    else:
        row_scale = scale.reshape(1, 1).expand(x.shape[0], 1).contiguous()
    return (xf / row_scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), row_scale


# ---- the runner ---------------------------------------------------------------------------------
def scaled_mm(xq: torch.Tensor, x_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
              bias: torch.Tensor | None, out_dtype: torch.dtype, fast_accum: bool = _FAST_ACCUM) -> torch.Tensor:
    """(xq * x_scale) @ (w * w_scale[:, None]).T + bias in out_dtype: torch._scaled_mm with row-wise
    scales (x_scale [M, 1], w_scale [N]; cuBLASLt on CUDA)."""
    # Row-wise scales with a bias in the epilogue fail on an H200 (cuBLASLt: CUBLAS_STATUS_NOT_SUPPORTED,
    # torch 2.11), so the bias is added after the matmul.
    y = torch._scaled_mm(xq, w.t(), scale_a=x_scale, scale_b=w_scale.view(1, -1), out_dtype=out_dtype,
                         use_fast_accum=fast_accum)
    return y if bias is None else y + bias


class RowScaledLinear(nn.Module):
    """What the FP8 and int8 runners share (Fp8Linear here, int8_linear.Int8Linear): 1-byte codes
    [out, in] with one float32 scale per output row, W = weight * weight_scale[:, None]; how the
    activations enter (ACTIVATIONS; static ones with the checkpoint's input_scale); and on the CPU,
    which runs them for correctness (tests, development), not for speed or memory, a dequantized
    float32 copy beside the codes: torch widens fp8 slowly there (4 ms for a 3072 x 576 weight, 20x
    its float matmul), so activations are rounded in place and the product runs at float speed --
    the GPU's arithmetic. Subclasses set `w8a8`: whether activations are quantized."""

    code_dtype: torch.dtype  # the weight codes' dtype
    weight: torch.Tensor  # code_dtype [out, in]
    weight_scale: torch.Tensor  # float32 [out]
    input_scale: torch.Tensor | None  # float32 [1], static activations only
    dequantized: torch.Tensor | None  # CPU only: float32 [out, in]
    w8a8: bool

    def __init__(self, weight: torch.Tensor, weight_scale: torch.Tensor, *, activations: str,
                 input_scale: torch.Tensor | None = None):
        super().__init__()
        if activations not in ACTIVATIONS:
            raise ValueError(f"activations must be one of {', '.join(ACTIVATIONS)}, got {activations!r}")
        if (activations == "static") != (input_scale is not None):
            raise ValueError("static activations need an input_scale, and only they take one")
        if (weight.dtype != self.code_dtype or weight.dim() != 2 or weight_scale.dtype != torch.float32
                or weight_scale.shape != weight.shape[:1]):
            name = "fp8" if self.code_dtype == FP8_DTYPE else str(self.code_dtype).removeprefix("torch.")
            raise ValueError(f"need an {name} weight [out, in] and float32 scales [out], got {weight.dtype} "
                             f"{tuple(weight.shape)} and {weight_scale.dtype} {tuple(weight_scale.shape)}")
        self.out_features, self.in_features = weight.shape
        self.activations = activations
        self.register_buffer("weight", weight, persistent=False)
        self.register_buffer("weight_scale", weight_scale, persistent=False)
        self.register_buffer("input_scale", input_scale, persistent=False)
        cuda = weight.device.type == "cuda"
        self.register_buffer("dequantized", None if cuda else self.dequantize(), persistent=False)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, activations={self.activations}"

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight the layer multiplies by, [out, in] in `dtype`."""
        return (self.weight.float() * self.weight_scale[:, None]).to(dtype)

    def one_token_w8a8(self) -> tuple[bool, torch.Tensor | None]:
        """For the fused one-token kernels: whether a one-row step quantizes its activations (per
        token, or with the static input scale, the second value; a tensor-wide dynamic scale is the
        token's own at one row), or keeps them in the model dtype (weight-only)."""
        return self.w8a8, self.input_scale


class Fp8Linear(RowScaledLinear):
    """y = x @ (weight * weight_scale[:, None]).T + bias, in x's dtype (see the module docstring)."""

    code_dtype = FP8_DTYPE

    def __init__(self, weight: torch.Tensor, weight_scale: torch.Tensor, *, activations: str,
                 input_scale: torch.Tensor | None = None):
        super().__init__(weight, weight_scale, activations=activations, input_scale=input_scale)
        cuda = weight.device.type == "cuda"
        # cuBLASLt's FP8 GEMM wants K and N in multiples of 16; other shapes stay weight-only.
        self.w8a8 = activations != "weight-only" and (not cuda or (self.in_features % 16 == 0
                                                                   and self.out_features % 16 == 0))

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        rows = x2.shape[0]
        w8a8 = self.w8a8
        if self.dequantized is not None:  # CPU
            if w8a8:
                xq, x_scale = quantize_activations_torch(x2, self._input_scale(x2))
                x2 = xq.float() * x_scale
            y = F.linear(x2.to(self.dequantized.dtype), self.dequantized).to(x.dtype)
            y = y if bias is None else y + bias
        elif rows == 1 and w8a8:
            y = w8a8_dot_gemv(x2.contiguous(), self.weight, self.weight_scale, bias, input_scale=self.input_scale)
        elif rows == 1:
            y = gemv(x2.contiguous(), self.weight, bias, weight_scale=self.weight_scale)
        elif not w8a8:  # weight-only FP8 (a W8A16 checkpoint, or shapes cuBLASLt refuses) in batches
            y = fp8_weight_linear(x2.contiguous(), self.weight, self.weight_scale, bias)
        else:
            # A few rows (decode batches, verify steps): the tensor-core product quantizes them itself.
            in_scale = self._input_scale(x2)
            few = dense_gemv_cuda.few_token_product(x2, self.weight, bias, weight_scale=self.weight_scale,
                                                    input_scale=in_scale)
            if few is not None:
                y = few
            else:
                xq, x_scale = quantize_activations_triton(x2, in_scale)
                y = scaled_mm(xq, x_scale, self.weight, self.weight_scale, bias, x.dtype)
        return y.reshape(*lead, self.out_features)

    def _input_scale(self, x: torch.Tensor) -> torch.Tensor | None:
        """The activations' per-tensor scale, or None for per token."""
        if self.activations == "dynamic-tensor":
            return (x.abs().amax().float().clamp(min=_MIN_AMAX) / FP8_MAX).reshape(1)
        return self.input_scale
