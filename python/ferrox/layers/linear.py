"""Linear layers whose checkpoint tensors may arrive in pieces.

`MergedLinear` holds several HF projections (q/k/v, or gate/up) as one weight so a layer runs one
matmul instead of three; `load_shard` copies each checkpoint piece into its row range.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, *, bias: bool, dtype: torch.dtype,
                 device: torch.device | str | None = None):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype, device=device),
                                   requires_grad=False)
        self.bias = (nn.Parameter(torch.empty(out_features, dtype=dtype, device=device), requires_grad=False)
                     if bias else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class MergedLinear(Linear):
    """Output rows are the named shards stacked in order, e.g. {"q": 576, "k": 192, "v": 192}."""

    def __init__(self, in_features: int, shard_sizes: dict[str, int], *, bias: bool, dtype: torch.dtype,
                 device: torch.device | str | None = None):
        super().__init__(in_features, sum(shard_sizes.values()), bias=bias, dtype=dtype, device=device)
        self.shard_sizes = dict(shard_sizes)
        self.shard_offsets: dict[str, int] = {}
        offset = 0
        for name, size in shard_sizes.items():
            self.shard_offsets[name] = offset
            offset += size

    def load_shard(self, param_name: str, shard: str, tensor: torch.Tensor) -> None:
        """Copy a checkpoint tensor (weight [size, in] or bias [size]) into its shard's rows."""
        param = self.weight if param_name == "weight" else self.bias
        if param is None:
            raise ValueError(f"{param_name} given for a layer built without one")
        start, size = self.shard_offsets[shard], self.shard_sizes[shard]
        target = param.data[start:start + size]
        if tuple(tensor.shape) != tuple(target.shape):
            raise ValueError(f"shard {shard!r} {param_name}: checkpoint shape {tuple(tensor.shape)}, "
                             f"model expects {tuple(target.shape)}")
        target.copy_(tensor)

    def split(self, out: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return out.split(list(self.shard_sizes.values()), dim=-1)
