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

    def dequantize(self) -> torch.Tensor:
        """float32 [rows, cols], as the `gguf` package dequantizes it (the float path's values)."""
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        w = np.asarray(dequantize(self.raw, GGMLQuantizationType[self.type_name]), dtype=np.float32)
        return torch.from_numpy(np.ascontiguousarray(w.reshape(self.shape)))
