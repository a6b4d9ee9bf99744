"""The int8 linear runner: int8 weights with one float32 scale per output row (W = q * scale[:, None]),
read from compressed-tensors "int-quantized" checkpoints (layers/quant/compressed_tensors_int8.py).

Activations are quantized as vLLM quantizes them for int8 W8A8: symmetric, scale = absmax / 127
(per token at run time, per tensor at run time, or the checkpoint's static input scale), codes
q = clamp(round_half_to_even(x / scale), -128, 127); weight-only checkpoints (W8A16) keep them in
the model dtype. How a layer multiplies (`Int8Linear`):

- CUDA, W8A8, one row (a batch-1 decode step): the tensor-core split-K product that quantizes the
  token itself (kernels/w8a8_dot_gemv.py, as FP8's), one launch; the fused decode path
  (attention/fused_decode.py) runs whole decoder layers so, reading `layer.weight` (int8),
  `layer.weight_scale` and `one_token_w8a8()`. Its row sums are the int8 GEMM's, to the bit.
- CUDA, W8A8, more rows: the rows quantized in one Triton launch (fp8_linear.py's row quantizer, int8
  variant), then the Triton int8 GEMM (kernels/int8_gemm.py): tensor-core products with exact int32
  sums and the scales and bias in its epilogue. It reads the weight as stored, [N, K]
  row-major. (torch._int_mm, cuBLASLt's int8 GEMM, plus an epilogue launch measured ~2x slower at
  1024-4096 rows on an H200 and needs more than 16 rows: benches/RESULTS.md, twenty-fourth session.)
- CUDA, weight-only: the fp8 weight-only kernels, which widen each 1-byte weight in registers (an
  int8 converts to fp32 / bf16 / fp16 exactly, as an E4M3 value does): the CUDA-core GEMV for one
  row (kernels/gemv.py, weight_scale in its epilogue), kernels/fp8_weight_gemm.py for more.
- CPU (tests, development): the same arithmetic on a dequantized float32 copy of the weight, the
  activations rounded through int8 in place (the GPU's codes and scales); for correctness, not
  speed or memory.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ferrox.kernels.fp8_weight_gemm import fp8_weight_linear
from ferrox.kernels.gemv import gemv
from ferrox.kernels.int8_gemm import int8_gemm
from ferrox.kernels.row_quant import quantize_activations_triton
from ferrox.kernels.w8a8_dot_gemv import w8a8_dot_gemv
from ferrox.layers.quant.fp8_linear import RowScaledLinear

INT8_MAX = 127.0
_MIN_AMAX = 1e-12  # an all-zero row still gets a finite, nonzero scale (as fp8_linear's)


# ---- quantizing ---------------------------------------------------------------------------------
def quantize_int8_per_row(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 [out, in], float32 [out]) with weight ~= q * scale[:, None], each row's absmax -> 127
    (dummy weights; checkpoints come quantized)."""
    w = weight.float()
    scale = w.abs().amax(dim=1).clamp(min=_MIN_AMAX) / INT8_MAX
    return torch.round(w / scale[:, None]).clamp(-INT8_MAX - 1, INT8_MAX).to(torch.int8), scale


def quantize_int8_torch(x: torch.Tensor, scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (int8 [M, K], float32 [M, 1]): per token (each row's absmax maps to 127) or, given
    `scale` (float32, one element), that scale for every row. torch.round rounds half to even."""
    xf = x.float()
    if scale is None:
        row_scale = xf.abs().amax(dim=1, keepdim=True).clamp(min=_MIN_AMAX) / INT8_MAX
    else:
        row_scale = scale.float().reshape(1, 1).expand(x.shape[0], 1).contiguous()
    return torch.round((xf / row_scale).clamp(-INT8_MAX - 1, INT8_MAX)).to(torch.int8), row_scale


def quantize_int8_triton(x: torch.Tensor, scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_int8_torch in one Triton launch (CUDA): the codes and scales it computes on the CPU
    (the kernel divides correctly rounded, as the CPU does; torch's CUDA division by a Python number
    multiplies by its reciprocal, which can be an ulp off)."""
    return quantize_activations_triton(x, scale, dtype=torch.int8)


# ---- the runner ---------------------------------------------------------------------------------
class Int8Linear(RowScaledLinear):
    """y = x @ (weight * weight_scale[:, None]).T + bias, in x's dtype (see the module docstring)."""

    code_dtype = torch.int8
    int8_max: torch.Tensor  # 127.0, on the weight's device

    def __init__(self, weight: torch.Tensor, weight_scale: torch.Tensor, *, activations: str,
                 input_scale: torch.Tensor | None = None):
        super().__init__(weight.contiguous(), weight_scale.contiguous(), activations=activations,
                         input_scale=input_scale)
        self.w8a8 = activations != "weight-only"
        # A per-tensor dynamic scale is amax / 127 divided by a tensor: on CUDA a true division, as the
        # CPU's (a Python divisor becomes a multiplication by its reciprocal there).
        self.register_buffer("int8_max", torch.tensor(INT8_MAX, device=weight.device), persistent=False)

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if self.dequantized is not None:  # CPU
            if self.w8a8:
                xq, x_scale = quantize_int8_torch(x2, self._input_scale(x2))
                x2 = xq.float() * x_scale
            y = F.linear(x2.to(self.dequantized.dtype), self.dequantized).to(x.dtype)
            y = y if bias is None else y + bias
        elif self.w8a8:
            y = self._w8a8_cuda(x2, bias)
        elif x2.shape[0] == 1:
            y = gemv(x2.contiguous(), self.weight, bias, weight_scale=self.weight_scale)
        else:
            y = fp8_weight_linear(x2.contiguous(), self.weight, self.weight_scale, bias)
        return y.reshape(*lead, self.out_features)

    def _w8a8_cuda(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if x.shape[0] == 1:  # (a per-tensor dynamic scale is the token's own at one row)
            return w8a8_dot_gemv(x.contiguous(), self.weight, self.weight_scale, bias, input_scale=self.input_scale)
        xq, x_scale = quantize_int8_triton(x, self._input_scale(x))
        return int8_gemm(xq, x_scale, self.weight, self.weight_scale, bias, x.dtype)

    def _input_scale(self, x: torch.Tensor) -> torch.Tensor | None:
        """The activations' per-tensor scale (float32 [1]), or None for per token."""
        if self.activations == "dynamic-tensor":
            return (x.abs().amax().float().clamp(min=_MIN_AMAX) / self.int8_max).reshape(1)
        return self.input_scale
