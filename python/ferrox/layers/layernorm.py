"""RMSNorm, optionally fused with the residual add that precedes it in every decoder layer."""

from __future__ import annotations

import torch
from torch import nn

from ferrox.layers.ops import DeviceOps, for_device


class RMSNorm(nn.Module):
    """`ops` (layers/ops.py) is the op set chosen when the model is built; by default the one of
    `device` (Triton kernels on CUDA, torch elsewhere)."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype, device: torch.device | str | None = None,
                 ops: DeviceOps | None = None):
        super().__init__()
        self.size = size
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype, device=device), requires_grad=False)
        self.ops = ops if ops is not None else for_device(device)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """norm(x), or with `residual`: (norm(x + residual), x + residual) -- the sum is the next residual."""
        if residual is None:
            return self.ops.rms_norm(x, self.weight, self.eps)
        return self.ops.fused_add_rms_norm(x, residual, self.weight, self.eps)
