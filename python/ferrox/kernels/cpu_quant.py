"""Quantized matmuls on the CPU, in Rust (rust/cpu/, `ferrox._core.CpuQuantMatrix`).

A matrix holds groups of 32 columns, w = scale * q + offset with q of 4 or 8 bits (every GGUF
block format maps onto that: layers/quant/gguf_blocks.py). Every product runs the int8 dot-product
kernel: activations rounded to int8 per group of 32, integer dot products, weights read once for
all rows (four rows share each unpacked weight group). A row's result is bit-identical whatever
rows share its product, so outputs do not depend on batching (a float32 BLAS path for many rows
measured about as fast, but rounds differently from the few-row kernel, and a prompt's tokens
would then depend on how the scheduler chunked it).

The kernels run on their own threads (`_core.cpu_set_num_threads`; worker/cpu_threads.py keeps
them equal to torch's).
"""

from __future__ import annotations

import numpy as np
import torch

from ferrox import _core


def pack(q: np.ndarray, scale: np.ndarray, offset: np.ndarray, bits: int) -> _core.CpuQuantMatrix:
    """q uint8 [rows, cols] (one value a byte, below 2**bits); scale, offset float32 [rows, cols/32]."""
    return _core.CpuQuantMatrix(np.ascontiguousarray(q, dtype=np.uint8), np.ascontiguousarray(scale, dtype=np.float32),
                                np.ascontiguousarray(offset, dtype=np.float32), bits)


def quant_matmul(matrix: _core.CpuQuantMatrix, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """float32 x [m, cols] @ w.T (+ bias) -> float32 [m, rows]."""
    x = x.to(torch.float32).contiguous()
    out = torch.empty(x.shape[0], matrix.rows, dtype=torch.float32)
    matrix.matmul(x.numpy(), out.numpy(), None if bias is None else bias.to(torch.float32).contiguous().numpy())
    return out
