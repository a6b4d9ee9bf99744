"""Gated DeltaNet: the linear-attention token mixer of Qwen3-Next and Qwen3.5 / 3.6 (three of every four layers).

Per token: one projection gives the mixer's q, k, v (through a short causal convolution with SiLU), an output
gate z and, per value head, beta (the write strength, sigmoid) and a decay (g = -exp(A_log) * softplus(a +
dt_bias), in log space). A per-request state S [value heads, key dim, value dim] then follows the gated delta
rule (layers/gated_delta_rule.py): S <- exp(g) S, S <- S + k (beta (v - S^T k))^T, o = S^T q; o is RMS-normed per
head, times silu(z), and projected back. Query and key heads may be fewer than value heads: each serves
num_v_heads / num_k_heads consecutive ones.

The states live in pools of rows (worker/recurrent_states.py binds them; row 0 is scratch); a step's
AttentionMetadata.state_rows names each request's row, and a request whose step starts at position 0 starts from
zeros whatever its row holds (`recurrent_step`), so neither rows nor padding need zeroing and CUDA graphs replay
decode steps as they are.

Checkpoint layout (Qwen3.5): in_proj_qkv [2 key_dim + value_dim, hidden] (all q heads, all k heads, all v heads),
in_proj_z [value_dim, hidden], in_proj_b / in_proj_a [num_v_heads, hidden], conv1d.weight [conv_dim, 1, W],
A_log and dt_bias [num_v_heads], norm.weight [head_v_dim], out_proj [hidden, value_dim]. The four input
projections are one merged matmul here (`in_proj`); Qwen3-Next's fused in_proj_qkvz / in_proj_ba are split into
these at load (models/qwen3_5.py).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ferrox.layers.causal_conv import causal_conv1d_varlen
from ferrox.layers.gated_delta_rule import gated_delta_rule_varlen
from ferrox.layers.linear import MergedLinear, RowParallelLinear


def recurrent_step(meta: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """(state rows [num_reqs], has_state [num_reqs] bool) of a step, on its device: a request continues its state
    when tokens were computed before this step (seq_len > query_len). Device ops only (CUDA-graph safe)."""
    qsl = meta.query_start_loc
    has_state = (meta.seq_lens - (qsl[1:] - qsl[:-1])) > 0
    rows = meta.state_rows
    if rows is None:  # (profiling, warm-up: scratch row 0)
        rows = torch.zeros(has_state.shape[0], dtype=torch.int32, device=has_state.device)
    return rows, has_state


class GatedRMSNorm(nn.Module):
    """RMSNorm over each value head, then times silu(gate): in float32, the weight applied in the input's dtype
    before the gate (transformers' Qwen3_5RMSNormGated, whose weight starts at ones: not zero-centred)."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype, device: torch.device | str | None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype, device=device), requires_grad=False)

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        xf = x.float()
        normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(dtype)
        return (self.weight * normed * F.silu(gate.float())).to(dtype)


class ConvKernel(nn.Module):
    """The short convolution's depthwise kernel [channels, W] (a module so its checkpoint name is conv1d.weight)."""

    def __init__(self, channels: int, width: int, dtype: torch.dtype, device: torch.device | str | None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, width, dtype=dtype, device=device), requires_grad=False)


class GatedDeltaNet(nn.Module):
    def __init__(self, hidden_size: int, *, num_k_heads: int, num_v_heads: int, head_k_dim: int, head_v_dim: int,
                 conv_kernel: int, eps: float, dtype: torch.dtype, device: torch.device | str | None):
        super().__init__()
        if num_v_heads % num_k_heads:
            raise ValueError(f"linear_num_value_heads {num_v_heads} must be a multiple of linear_num_key_heads "
                             f"{num_k_heads}")
        self.num_k_heads, self.num_v_heads = num_k_heads, num_v_heads
        self.head_k_dim, self.head_v_dim = head_k_dim, head_v_dim
        self.key_dim, self.value_dim = num_k_heads * head_k_dim, num_v_heads * head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.conv_kernel = conv_kernel
        self.in_proj = MergedLinear(hidden_size, {"qkv": self.conv_dim, "z": self.value_dim, "b": num_v_heads,
                                                  "a": num_v_heads}, bias=False, dtype=dtype, device=device)
        # The depthwise convolution's kernel, [conv_dim, W] (the checkpoint's conv1d.weight [conv_dim, 1, W]).
        self.conv1d = ConvKernel(self.conv_dim, conv_kernel, dtype, device)
        # (float32 as transformers keeps them: exp(A_log) and softplus(a + dt_bias) are the decay's log)
        self.A_log = nn.Parameter(torch.empty(num_v_heads, dtype=torch.float32, device=device), requires_grad=False)
        self.dt_bias = nn.Parameter(torch.empty(num_v_heads, dtype=torch.float32, device=device),
                                    requires_grad=False)
        self.norm = GatedRMSNorm(head_v_dim, eps, dtype, device)
        self.out_proj = RowParallelLinear(self.value_dim, hidden_size, bias=False, dtype=dtype, device=device)
        self.conv_states: torch.Tensor | None = None
        self.ssm_states: torch.Tensor | None = None

    # ---- worker/recurrent_states.py ----------------------------------------------------------------
    def state_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        return (self.conv_dim, self.conv_kernel - 1), (self.num_v_heads, self.head_k_dim, self.head_v_dim)

    def bind_states(self, conv_states: torch.Tensor, ssm_states: torch.Tensor) -> None:
        self.conv_states, self.ssm_states = conv_states, ssm_states

    def forward(self, x: torch.Tensor, meta: Any, step: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]. step: recurrent_step(meta), computed once per forward."""
        if self.conv_states is None or self.ssm_states is None:
            raise RuntimeError("GatedDeltaNet: no recurrent states bound (worker/recurrent_states.py)")
        t = x.shape[0]
        rows, has_state = step
        proj = self.in_proj(x)
        mixed, z, b, a = proj.split([self.conv_dim, self.value_dim, self.num_v_heads, self.num_v_heads], dim=-1)
        mixed = causal_conv1d_varlen(mixed, self.conv1d.weight, None, self.conv_states, rows, meta.query_start_loc,
                                     meta.query_start_loc_cpu, has_state, activation="silu",
                                     decode_only=meta.decode_only)
        q, k, v = mixed.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        beta = torch.sigmoid(b.float())
        g = -torch.exp(self.A_log) * F.softplus(a.float() + self.dt_bias)
        o = gated_delta_rule_varlen(q.reshape(t, self.num_k_heads, self.head_k_dim),
                                    k.reshape(t, self.num_k_heads, self.head_k_dim),
                                    v.reshape(t, self.num_v_heads, self.head_v_dim), g, beta, self.ssm_states, rows,
                                    meta.query_start_loc, meta.query_start_loc_cpu, has_state,
                                    decode_only=meta.decode_only)
        o = self.norm(o, z.reshape(t, self.num_v_heads, self.head_v_dim))
        return self.out_proj(o.reshape(t, self.value_dim))
