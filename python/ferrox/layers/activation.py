"""Gated activation of the Llama/Qwen MLP: silu(gate) * up over one merged gate_up projection."""

from __future__ import annotations

import torch
from torch import nn

from ferrox.layers.ops import DeviceOps, for_device


class SiluAndMul(nn.Module):
    """`ops` (layers/ops.py) is the op set chosen when the model is built; by default plain torch."""

    def __init__(self, ops: DeviceOps | None = None):
        super().__init__()
        self.ops = ops if ops is not None else for_device()

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self.ops.silu_and_mul(gate_up)
