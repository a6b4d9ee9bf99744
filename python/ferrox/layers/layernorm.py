"""RMSNorm, optionally fused with the residual add that precedes it in every decoder layer."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, dtype: torch.dtype, device: torch.device | str | None = None):
        super().__init__()
        self.size = size
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype, device=device), requires_grad=False)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """norm(x), or with `residual`: (norm(x + residual), x + residual) -- the sum is the next residual."""
        if residual is not None:
            x = x + residual
            residual = x
        if x.dtype == torch.float32:
            out = F.rms_norm(x, (self.size,), self.weight, self.eps)
        else:
            # Half precision: normalise in float32 and round once, as the HF reference does.
            out = F.rms_norm(x.float(), (self.size,), None, self.eps).to(x.dtype) * self.weight
        return out if residual is None else (out, residual)
