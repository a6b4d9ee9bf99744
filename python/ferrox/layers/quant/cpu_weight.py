"""`CpuQuantWeight`: a linear weight kept in GGUF-style groups on the CPU, multiplied by the
Rust kernels (kernels/cpu_quant.py).

The shards of a merged layer (q/k/v, gate/up) stack row-wise into one matrix; 4-bit groups stay
4-bit, and a layer with any wider shard (Q8_0, the 5-bit formats, requantized K-quants) is 8-bit
throughout. The weights are exactly the shards' `scale * q + offset` (float32 scales, no
rounding); activations are rounded to int8 per group of 32 in the few-row kernel, as llama.cpp's
are (the accuracy cost is measured in benches/bench_cpu_quant.py).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from ferrox.kernels.cpu_quant import pack, quant_matmul
from ferrox.layers.quant.gguf_blocks import GroupAffine


class CpuQuantWeight(nn.Module):
    def __init__(self, parts: list[GroupAffine]):
        """parts: row blocks stacked in order (the shards of a merged layer), same column count."""
        super().__init__()
        cols = {p.shape[1] for p in parts}
        if len(cols) != 1:
            raise ValueError(f"quantized shards differ in columns: {sorted(cols)}")
        self.in_features = cols.pop()
        self.out_features = sum(p.shape[0] for p in parts)
        self.exact = all(p.exact for p in parts)
        bits = 8 if any(p.bits > 4 for p in parts) else 4
        self.matrix = pack(np.concatenate([p.q for p in parts]), np.concatenate([p.scale for p in parts]),
                           np.concatenate([p.offset for p in parts]), bits)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, bits={self.matrix.bits}, exact={self.exact}"

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        lead = x.shape[:-1]
        y = quant_matmul(self.matrix, x.reshape(-1, self.in_features), bias)
        return y.to(x.dtype).reshape(*lead, self.out_features)

    def dequantize(self) -> torch.Tensor:
        """float32 [out, in]: the weight the kernels multiply by."""
        return torch.from_numpy(self.matrix.dequantize())
