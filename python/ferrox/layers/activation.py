"""Gated activation of the Llama/Qwen MLP: silu(gate) * up over one merged gate_up projection."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        if gate_up.is_cuda and gate_up.dim() == 2 and gate_up.stride(-1) == 1:
            # Triton (ferrox/kernels/activation.py): one read of [gate | up], one write, silu in fp32.
            from ferrox.kernels.activation import silu_and_mul

            return silu_and_mul(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up
