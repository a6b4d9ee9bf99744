"""Ungated MLPs: down_proj(act(up_proj(x))), no gate projection -- Arcee's ReLU-squared (transformers' NemotronMLP,
models/arcee.py) and Apertus's xIELU (models/apertus.py).

The up projection is a one-shard MergedLinear under the name `gate_up_proj`: the Llama loader folds a checkpoint's
`up_proj` into that layer's "up" shard (its name map), and a tensor-parallel rank holds its rows of it as it would
of a gated MLP's. These layers are not the fused one-token kernels' SiLU-gated shape: a model built on them keeps
the general decode path (LlamaModel.fused_one_token False).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ferrox.distributed.sharding import materialize
from ferrox.layers.linear import MergedLinear, RowParallelLinear
from ferrox.layers.ops import DeviceOps
from ferrox.model_spec import ModelSpec


class XIELU(nn.Module):
    """xIELU (Huang et al., 2024), as transformers' XIELUActivation computes it: alpha_p = softplus(a_p), alpha_n =
    beta + softplus(a_n); x > 0: alpha_p x^2 + beta x; else (expm1(min(x, eps)) - x) alpha_n + beta x. a_p, a_n are
    learned per layer ([1]); beta and eps are stored beside them (buffers of the checkpoint)."""

    def __init__(self, dtype: torch.dtype, device: torch.device | str | None):
        super().__init__()

        def scalar() -> nn.Parameter:
            return nn.Parameter(torch.zeros(1, dtype=dtype, device=device), requires_grad=False)

        self.alpha_p, self.alpha_n, self.beta, self.eps = scalar(), scalar(), scalar(), scalar()

    def load_weight(self, param_name: str, tensor, shard: str | None = None) -> None:
        """A scalar ([] for the buffers, [1] for the learned ones) into its [1] parameter."""
        value = materialize(tensor)
        if value.numel() != 1:
            raise ValueError(f"checkpoint shape {tuple(value.shape)}, model expects one value")
        getattr(self, param_name).data.copy_(value.reshape(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        alpha_p = F.softplus(self.alpha_p)
        alpha_n = self.beta + F.softplus(self.alpha_n)
        return torch.where(x > 0, alpha_p * x * x + self.beta * x,
                           (torch.expm1(torch.minimum(x, self.eps)) - x) * alpha_n + self.beta * x)


class ReluSquared(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.square(F.relu(x))


class UngatedMLP(nn.Module):
    """down_proj(act(up_proj(x))); `act_fn` is the checkpoint's name of the activation module (xIELU's parameters)."""

    def __init__(self, spec: ModelSpec, act: nn.Module, dtype: torch.dtype, device: torch.device | str | None):
        super().__init__()
        inter = spec.intermediate_size
        self.gate_up_proj = MergedLinear(spec.hidden_size, {"up": inter}, bias=spec.mlp_bias, dtype=dtype,
                                         device=device)
        self.act_fn = act
        self.down_proj = RowParallelLinear(inter, spec.hidden_size, bias=spec.mlp_bias, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor, reduce: bool = True) -> torch.Tensor:
        h = self.act_fn(self.gate_up_proj(x))
        return self.down_proj(h) if reduce else self.down_proj(h, reduce=False)


class ReluSquaredMLP(UngatedMLP):
    def __init__(self, spec: ModelSpec, ops: DeviceOps, dtype: torch.dtype, device: torch.device | str | None):
        super().__init__(spec, ReluSquared(), dtype, device)


class XieluMLP(UngatedMLP):
    def __init__(self, spec: ModelSpec, ops: DeviceOps, dtype: torch.dtype, device: torch.device | str | None):
        super().__init__(spec, XIELU(dtype, device), dtype, device)


__all__ = ["ReluSquaredMLP", "UngatedMLP", "XIELU", "XieluMLP"]
