"""`Int4GroupWeight`: a linear weight packed for torch's int4 CPU matmul.

The kernel (`aten._weight_int4pack_mm_for_cpu`, checked numerically in the tests) computes
y = x @ w.T with w[n, k] = (q[n, k] - 8) * s[g, n] + z[g, n], g = k // group, q 4-bit. A
`GroupAffine` w = scale * q + offset is that with s = scale, z = offset + 8 * scale.

8-bit q (Q8_0, the 5-bit formats, requantized K-quants) splits into two 4-bit planes,
q = 16 * hi + lo: the lo plane has (scale, offset + 8 scale), the hi plane (16 scale, 128 scale),
and the two sum to scale * q + offset. The planes sit side by side along k and the input is
repeated, [x | x], so one call reads both: 8 bits a weight, exact.

Activations go in as bfloat16: with float32 inputs the op takes a reference path that measured
15-60x slower than float32 BLAS (benches/bench_cpu_quant.py notes); with bfloat16 it is the fast
AVX-512 kernel. Scales and zeros are therefore bfloat16 too (the op wants one dtype), so the
weights are exact to bfloat16 rounding of each group's scale and zero, not bit-exact.
"""

from __future__ import annotations

import torch
from torch import nn

from ferrox.layers.quant.gguf_blocks import GROUP, GroupAffine

_ROW_MULTIPLE = 16  # the packing op wants the output rows in tiles of 16
_DTYPE = torch.bfloat16


class Int4GroupWeight(nn.Module):
    def __init__(self, parts: list[GroupAffine]):
        """parts: row blocks stacked in order (the shards of a merged layer), same column count."""
        super().__init__()
        cols = {p.shape[1] for p in parts}
        if len(cols) != 1:
            raise ValueError(f"quantized shards differ in columns: {sorted(cols)}")
        self.in_features = cols.pop()
        self.out_features = sum(p.shape[0] for p in parts)
        self.planes = 2 if any(p.bits > 4 for p in parts) else 1
        self.exact = all(p.exact for p in parts)
        q = torch.cat([torch.from_numpy(p.q) for p in parts]).to(torch.int32)
        scale = torch.cat([torch.from_numpy(p.scale) for p in parts])
        offset = torch.cat([torch.from_numpy(p.offset) for p in parts])
        if self.planes == 1:
            q_planes, s, z = q, scale, offset + 8 * scale
        else:
            q_planes = torch.cat([q & 0x0F, q >> 4], dim=1)
            s = torch.cat([scale, 16 * scale], dim=1)
            z = torch.cat([offset + 8 * scale, 128 * scale], dim=1)
        pad = -self.out_features % _ROW_MULTIPLE
        if pad:  # zero rows (q 0, scale 0, zero 0) whose outputs are sliced off
            q_planes = torch.cat([q_planes, q_planes.new_zeros(pad, q_planes.shape[1])])
            s, z = torch.cat([s, s.new_zeros(pad, s.shape[1])]), torch.cat([z, z.new_zeros(pad, z.shape[1])])
        self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(q_planes, 1))
        # [groups, rows, (scale, zero)], the op's layout.
        self.register_buffer("scales_zeros", torch.stack([s, z], dim=-1).transpose(0, 1).contiguous().to(_DTYPE))

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, planes={self.planes}, exact={self.exact}"

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        lead = x.shape[:-1]
        xb = x.reshape(-1, self.in_features).to(_DTYPE)
        if self.planes == 2:
            xb = torch.cat([xb, xb], dim=1)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(xb, self.packed, GROUP, self.scales_zeros)
        if y.shape[1] != self.out_features:
            y = y[:, : self.out_features]
        y = y.to(x.dtype)
        if bias is not None:
            y = y + bias
        return y.reshape(*lead, self.out_features)

    def dequantize(self) -> torch.Tensor:
        """float32 [out, in]: the weight the kernel multiplies by (through the kernel itself, so
        tests see its exact values, bfloat16 rounding included)."""
        eye = torch.eye(self.in_features, dtype=torch.float32)
        return self.forward(eye).t().contiguous()
