"""Gated DeltaNet: the linear-attention token mixer of Qwen3-Next and Qwen3.5 / 3.6 (three of every four layers).

Per token: one projection gives the mixer's q, k, v (through a short causal convolution with SiLU), an output
gate z and, per value head, beta (the write strength, sigmoid) and a decay (g = -exp(A_log) * softplus(a +
dt_bias), in log space). A per-request state S [value heads, key dim, value dim] then follows the gated delta
rule (layers/gated_delta_rule.py): S <- exp(g) S, S <- S + k (beta (v - S^T k))^T, o = S^T q; o is RMS-normed per
head, times silu(z), and projected back. Query and key heads may be fewer than value heads: each serves
num_v_heads / num_k_heads consecutive ones.

The states live in pools of rows (worker/recurrent_states.py binds them; row 0 is scratch); a step's
AttentionMetadata.state_rows names each request's row, and a request whose step starts at position 0 starts from
zeros whatever its row holds (`step_state_rows`), so neither rows nor padding need zeroing and CUDA graphs replay
decode steps as they are.

Checkpoint layout (Qwen3.5): in_proj_qkv [2 key_dim + value_dim, hidden] (all q heads, all k heads, all v heads),
in_proj_z [value_dim, hidden], in_proj_b / in_proj_a [num_v_heads, hidden], conv1d.weight [conv_dim, 1, W],
A_log and dt_bias [num_v_heads], norm.weight [head_v_dim], out_proj [hidden, value_dim]. The input projections
are two merged matmuls here: `qkvz_proj` (shards q, k, v, z: models/qwen3_5.py cuts in_proj_qkv into its q, k and
v rows at load), which a quantized checkpoint quantizes, and `ba_proj` (b, a), which it keeps in the model dtype;
Qwen3-Next's fused in_proj_qkvz / in_proj_ba are split into Qwen3.5's names at load too.

Tensor parallelism: a rank holds num_k_heads / N key heads and the num_v_heads / N value heads they serve (each
key head's r = num_v_heads / num_k_heads value heads are consecutive, so rank i's key heads [i Hk/N, (i+1) Hk/N)
serve value heads [i Hv/N, (i+1) Hv/N)). Every projection shard splits evenly by rank, the conv kernel's q, k and v
channel blocks each give the rank's rows (`ConvKernel`), A_log and dt_bias its value heads, the gated norm (one
head wide) is replicated, out_proj is row-parallel over the value heads; the state pools hold the rank's heads
(`state_shapes`). The attributes num_k_heads, num_v_heads, key_dim, value_dim, conv_dim are this rank's.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ferrox.distributed.parallel_state import get_tp_group
from ferrox.distributed.sharding import Weight, even_split, materialize, narrow
from ferrox.layers.linear import MergedLinear, RowParallelLinear
from ferrox.layers.ops import DeviceOps, for_device
from ferrox.layers.quant.method import use_quant_config
from ferrox.model_spec import UnsupportedModelError


def step_state_rows(meta: Any) -> tuple[torch.Tensor, torch.Tensor]:
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
    """The short convolution's depthwise kernel [channels, W] (a module so its checkpoint name is conv1d.weight).
    Its checkpoint channels are blocks (q, k, v: `blocks` their full sizes); a tensor-parallel rank holds its
    even share of each block, stacked in order (the rows its qkvz_proj q, k and v shards yield)."""

    def __init__(self, blocks: tuple[int, ...], width: int, dtype: torch.dtype, device: torch.device | str | None):
        super().__init__()
        tp = get_tp_group()
        self.checkpoint_channels = sum(blocks)
        # (first checkpoint channel, channels) of each block's part on this rank
        self.parts: list[tuple[int, int]] = []
        base = 0
        for size in blocks:
            start, length = even_split(size, tp.size, tp.rank, "conv1d channels")
            self.parts.append((base + start, length))
            base += size
        channels = sum(length for _, length in self.parts)
        self.weight = nn.Parameter(torch.empty(channels, width, dtype=dtype, device=device), requires_grad=False)

    def load_weight(self, param_name: str, tensor: Weight, shard: str | None = None) -> None:
        """The checkpoint's conv1d.weight ([C, W] or [C, 1, W]): this rank's channels of each block."""
        if param_name != "weight":
            raise ValueError(f"{param_name}: the conv kernel has only a weight")
        value = materialize(tensor)
        value = value.reshape(value.shape[0], -1) if value.dim() == 3 else value
        width = self.weight.shape[1]
        if tuple(value.shape) != (self.checkpoint_channels, width):
            raise ValueError(f"checkpoint shape {tuple(value.shape)}, model expects "
                             f"{(self.checkpoint_channels, width)}")
        self.weight.data.copy_(torch.cat([value[start:start + length] for start, length in self.parts]))


class GatedDeltaNet(nn.Module):
    def __init__(self, hidden_size: int, *, num_k_heads: int, num_v_heads: int, head_k_dim: int, head_v_dim: int,
                 conv_kernel: int, eps: float, dtype: torch.dtype, device: torch.device | str | None,
                 ops: DeviceOps | None = None):
        """ops: the model's op set (layers/ops.py), which picks the delta rule's kernels; by default the device's."""
        super().__init__()
        self.ops = ops if ops is not None else for_device(device)
        if num_v_heads % num_k_heads:
            raise ValueError(f"linear_num_value_heads {num_v_heads} must be a multiple of linear_num_key_heads "
                             f"{num_k_heads}")
        tp = get_tp_group()
        if num_k_heads % tp.size:
            raise UnsupportedModelError(f"linear_num_key_heads ({num_k_heads}) is not divisible by "
                                        f"tensor_parallel_size ({tp.size})")
        # This rank's heads (module docstring): key heads, and the value heads they serve.
        self.num_k_heads, self.num_v_heads = num_k_heads // tp.size, num_v_heads // tp.size
        self.v_head_start = tp.rank * self.num_v_heads
        self.head_k_dim, self.head_v_dim = head_k_dim, head_v_dim
        self.key_dim, self.value_dim = self.num_k_heads * head_k_dim, self.num_v_heads * head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.conv_kernel = conv_kernel
        key_dim, value_dim = num_k_heads * head_k_dim, num_v_heads * head_v_dim  # (the checkpoint's)
        # q, k, v adjacent: their local rows are the convolution's input, in the kernel's channel order.
        self.qkvz_proj = MergedLinear(hidden_size, {"q": key_dim, "k": key_dim, "v": value_dim, "z": value_dim},
                                      bias=False, dtype=dtype, device=device)
        # b and a (a few rows a head) stay in the model dtype in quantized checkpoints, as the FP8 releases keep them.
        with use_quant_config(None):
            self.ba_proj = MergedLinear(hidden_size, {"b": num_v_heads, "a": num_v_heads}, bias=False, dtype=dtype,
                                        device=device)
        # The depthwise convolution's kernel, [conv_dim, W] (the checkpoint's conv1d.weight [conv_dim, 1, W]).
        self.conv1d = ConvKernel((key_dim, key_dim, value_dim), conv_kernel, dtype, device)
        # (float32 as transformers keeps them: exp(A_log) and softplus(a + dt_bias) are the decay's log)
        self.A_log = nn.Parameter(torch.empty(self.num_v_heads, dtype=torch.float32, device=device),
                                  requires_grad=False)
        self.dt_bias = nn.Parameter(torch.empty(self.num_v_heads, dtype=torch.float32, device=device),
                                    requires_grad=False)
        self.norm = GatedRMSNorm(head_v_dim, eps, dtype, device)
        self.out_proj = RowParallelLinear(value_dim, hidden_size, bias=False, dtype=dtype, device=device)
        self.conv_states: torch.Tensor | None = None
        self.ssm_states: torch.Tensor | None = None

    def load_weight(self, param_name: str, tensor: Weight, shard: str | None = None) -> None:
        """A_log / dt_bias [num_v_heads] (the checkpoint's): this rank's value heads (models/load_check.load_into)."""
        param = {"A_log": self.A_log, "dt_bias": self.dt_bias}.get(param_name)
        if param is None:
            raise ValueError(f"{param_name}: not a parameter of the linear attention itself")
        full = self.num_v_heads * get_tp_group().size
        if tuple(tensor.shape) != (full,):
            raise ValueError(f"checkpoint shape {tuple(tensor.shape)}, model expects {(full,)}")
        param.data.copy_(narrow(tensor, 0, self.v_head_start, self.num_v_heads))

    # ---- worker/recurrent_states.py ----------------------------------------------------------------
    def state_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """One request's (conv state, delta-rule state) on this rank: its channels and value heads."""
        return (self.conv_dim, self.conv_kernel - 1), (self.num_v_heads, self.head_k_dim, self.head_v_dim)

    def bind_states(self, conv_states: torch.Tensor, ssm_states: torch.Tensor) -> None:
        self.conv_states, self.ssm_states = conv_states, ssm_states

    def forward(self, x: torch.Tensor, meta: Any, step: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]. step: step_state_rows(meta), computed once per forward."""
        if self.conv_states is None or self.ssm_states is None:
            raise RuntimeError("GatedDeltaNet: no recurrent states bound (worker/recurrent_states.py)")
        t = x.shape[0]
        rows, has_state = step
        mixed, z = self.qkvz_proj(x).split([self.conv_dim, self.value_dim], dim=-1)
        b, a = self.ba_proj(x).split([self.num_v_heads, self.num_v_heads], dim=-1)
        mixed = self.ops.causal_conv1d(mixed, self.conv1d.weight, None, self.conv_states, rows, meta.query_start_loc,
                                       meta.query_start_loc_cpu, has_state, activation="silu",
                                       decode_only=meta.decode_only, draft_rows=meta.draft_state_rows,
                                       max_query_len=meta.max_query_len, live_lens=meta.live_query_lens)
        q, k, v = mixed.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        beta = torch.sigmoid(b.float())
        g = -torch.exp(self.A_log) * F.softplus(a.float() + self.dt_bias)
        o = self.ops.gated_delta_rule(q.reshape(t, self.num_k_heads, self.head_k_dim),
                                    k.reshape(t, self.num_k_heads, self.head_k_dim),
                                    v.reshape(t, self.num_v_heads, self.head_v_dim), g, beta, self.ssm_states, rows,
                                    meta.query_start_loc, meta.query_start_loc_cpu, has_state,
                                    decode_only=meta.decode_only, draft_rows=meta.draft_state_rows,
                                    max_query_len=meta.max_query_len, live_lens=meta.live_query_lens)
        o = self.norm(o, z.reshape(t, self.num_v_heads, self.head_v_dim))
        return self.out_proj(o.reshape(t, self.value_dim))
