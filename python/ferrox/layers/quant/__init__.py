"""Weights that stay quantized.

Checkpoint methods (method.py: QuantConfig / LinearWeightMethod; config.py resolves which):
- fp8.py                FP8 E4M3 weights: online (--quantization fp8) and the "fp8" checkpoint layout
- fp8_linear.py         the FP8 runner: one-token GEMV, W8A8 torch._scaled_mm, the activation quantizer
- compressed_tensors.py the compressed-tensors float8 layouts (W8A8, W8A16); routes int schemes to
  compressed_tensors_int4.py (W4A16, packed) and compressed_tensors_int8.py (int8 W8A8 / W8A16)
- int8_linear.py        the int8 runner: Triton int8 GEMM, the int8 activation quantizer
- awq.py / gptq.py      int4 checkpoints; int4_pack.py their shared layout and runner

GGUF blocks kept quantized on the CPU, multiplied by the Rust kernels (kernels/cpu_quant.py):

- gguf_blocks.py   GGUF block formats -> `GroupAffine` (w = scale * q + offset per group of 32)
- tensor.py        `QuantizedTensor`: one GGUF tensor's raw blocks, as the loader hands it to a layer
- cpu_weight.py    `CpuQuantWeight`: a layer's shards as one 4- or 8-bit matrix, and its matmul

Linear layers (layers/linear.py) take a `QuantizedTensor` in `load_weight` and, once loaded, run
the quantized matmul in `forward`; the loader picks this path for a quantized GGUF on the CPU when
the dtype is "auto" (loader/model_loader.py).
"""

from ferrox.layers.quant.cpu_weight import CpuQuantWeight
from ferrox.layers.quant.gguf_blocks import GroupAffine, decode_gguf
from ferrox.layers.quant.tensor import QuantizedTensor

__all__ = ["CpuQuantWeight", "GroupAffine", "QuantizedTensor", "decode_gguf"]
