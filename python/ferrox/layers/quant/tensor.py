"""`QuantizedTensor`: a GGUF tensor kept in its blocks, as the loader hands it to a layer."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ferrox.layers.quant.gguf_blocks import GroupAffine, decode_gguf


@dataclass(frozen=True, slots=True)
class QuantizedTensor:
    """A 2-D weight [rows, cols] in GGUF blocks: `raw` is uint8 [rows, bytes per row] (rows are
    independent, so row permutations such as the Q/K un-permute apply to it as to floats)."""

    type_name: str  # GGMLQuantizationType name: "Q4_1", "Q6_K", ...
    raw: np.ndarray
    shape: tuple[int, int]

    def decode(self) -> GroupAffine:
        return decode_gguf(self.type_name, self.raw, self.shape)

    def narrow(self, dim: int, start: int, length: int) -> QuantizedTensor:
        """Rows [start, start + length) (dim 0): a fused checkpoint tensor's part (Phi-3's qkv)."""
        if dim != 0:
            raise ValueError("a QuantizedTensor is cut by rows only (its blocks run along a row)")
        return QuantizedTensor(self.type_name, self.raw[start:start + length], (length, self.shape[1]))

    def take_rows(self, order: torch.Tensor) -> QuantizedTensor:
        """The rows in `order` (a permutation), as index_select(0, order) of the float weight."""
        return QuantizedTensor(self.type_name, np.ascontiguousarray(self.raw[order.numpy()]), self.shape)

    def dequantize(self) -> torch.Tensor:
        """float32 [rows, cols], as the `gguf` package dequantizes it (the float path's values)."""
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        w = np.asarray(dequantize(self.raw, GGMLQuantizationType[self.type_name]), dtype=np.float32)
        return torch.from_numpy(np.ascontiguousarray(w.reshape(self.shape)))
