"""The Mamba2 mixer: the state-space token mixer of hybrid models (IBM Granite 4.0-H; Nemotron-H's "M" layers).

Per token, as transformers' GraniteMoeHybridMambaLayer / Mamba2Mixer torch_forward:
- in_proj [hidden -> I + conv_dim + H] gives z (the gate, I = num_heads x head_dim), xBC (conv_dim = I + 2 G N)
  and dt (one per head);
- xBC goes through the short causal depthwise convolution (with its bias) and SiLU -- layers/causal_conv.py, the
  op Gated DeltaNet uses, its last W-1 inputs kept in the request's conv state -- and splits into x [H, P], B and C
  [G, N] (G = n_groups, each serving H / G consecutive heads);
- dt = softplus(dt + dt_bias), clamped to time_step_limit; A = -exp(A_log);
- the selective scan (layers/mamba2_ssm.py): S <- exp(dt A) S + B (dt x)^T, y = S^T C + D x, the state kept per
  request in a pool row;
- the gated RMSNorm: y * silu(z), RMS-normed over each of the G groups of I / G channels, times its weight
  (transformers' MambaRMSNormGated with norm_before_gate False);
- out_proj [I -> hidden].

The states live in pools of rows bound by worker/recurrent_states.py (row 0 scratch; a request starting at position
0 starts from zeros whatever its row holds: layers/gated_delta_net.py step_state_rows): the conv state [conv_dim,
W-1] and the SSM state [H, N, P]. Speculative verify steps keep the state after each draft in its draft rows, as
Gated DeltaNet does, so n-gram and draft-model proposals follow the accepted one.

Checkpoint layout (Granite 4.0-H's `mamba.*`, Nemotron-H's `mixer.*`): in_proj.weight [I + conv_dim + H, hidden]
(+ bias with mamba_proj_bias / use_bias), conv1d.weight [conv_dim, 1, W], conv1d.bias [conv_dim] (conv_bias),
dt_bias / A_log / D [H], norm.weight [I], out_proj.weight [hidden, I].

Tensor parallelism over R ranks, as vLLM's MambaMixer2 shards it: a rank holds H / R heads (x's channels, z's,
dt's, A_log, D, dt_bias) and the B / C groups those heads read -- its G / R groups when R divides G; the one group,
replicated, when G is 1; other group counts are refused (distributed/sharding.py mamba2_group_range). in_proj is
one checkpoint tensor whose five segments [z | x | B | C | dt] each give the rank its rows (`Mamba2InProj`), the
conv its channels of x, B and C (`Mamba2Conv`); out_proj is row-parallel (one all-reduce). The gated norm's groups
are whole on a rank when R divides G; the single group of G = 1 spans the ranks, so its sum of squares is
all-reduced (`GroupedGatedRMSNorm`). The state pools hold the rank's channels and heads (`state_shapes`); the
attributes num_heads, n_groups, intermediate_size and conv_dim are this rank's.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ferrox.distributed.parallel_state import get_tp_group
from ferrox.distributed.sharding import (
    CheckpointSlice,
    Weight,
    even_split,
    mamba2_group_range,
    materialize,
    narrow,
    row_block,
    shape_of,
)
from ferrox.layers.linear import MergedLinear, RowParallelLinear
from ferrox.layers.mamba2_ssm import mamba2_ssm_varlen
from ferrox.layers.ops import DeviceOps, TritonOps, for_device
from ferrox.model_spec import UnsupportedModelError


def _load_rows(param: torch.Tensor, tensor: Weight, start: int, full: int) -> None:
    """This rank's rows [start, start + len(param)) of a checkpoint vector of `full` entries."""
    if shape_of(tensor) != (full,):
        raise ValueError(f"checkpoint shape {shape_of(tensor)}, model expects {(full,)}")
    param.data.copy_(narrow(tensor, 0, start, param.shape[0]))


def check_mamba2_quantization(architecture: str, releases: str) -> None:
    """A Mamba2 hybrid's quantization, refused by name unless FP8 with per-tensor or per-channel scales (Mamba2InProj
    cuts its codes into segments; the dt segment's row per head fills no 128-row block). releases: the checkpoint
    layouts the family's published FP8 releases use, for the message."""
    from ferrox.layers.quant.fp8 import Fp8Config
    from ferrox.layers.quant.method import get_quant_config

    quant = get_quant_config()
    if quant is not None and not isinstance(quant, Fp8Config):
        algo = getattr(quant, "algo", None)
        raise UnsupportedModelError(
            f"quantization {quant.name!r}{f' (quant_algo {algo})' if algo else ''} is not supported for "
            f"{architecture}: it takes FP8 weights with per-tensor or per-channel scales ({releases}; "
            "quantization='fp8'); block-wise FP8 (the Mamba2 in_proj's dt rows fill no 128-row block), NVFP4 and "
            "integer formats are not")


class GroupedGatedRMSNorm(nn.Module):
    """y * silu(z), RMS-normed over each group of `group_size` channels, times the weight: in float32, the weight
    applied in the input's dtype (transformers' GraniteMoeHybridRMSNormGated / MambaRMSNormGated).

    size is the checkpoint's channel count; a tensor-parallel rank holds its even share of them (the channels of its
    heads). A group wider than that share (one group over all the ranks: n_groups 1) takes its sum of squares
    all-reduced, as vLLM's Mixer2RMSNormGated does; otherwise the rank holds whole groups and norms them alone."""

    def __init__(self, size: int, group_size: int, eps: float, dtype: torch.dtype, device: Any):
        super().__init__()
        if size % group_size:
            raise ValueError(f"gated norm: {size} channels do not split into groups of {group_size}")
        self.tp = get_tp_group()
        self.start, local = even_split(size, self.tp.size, self.tp.rank, "the Mamba2 gated norm's channels")
        self.full_size = size
        self.spans_ranks = group_size > local
        if (group_size != size if self.spans_ranks else local % group_size):
            raise UnsupportedModelError(f"the Mamba2 gated norm's groups of {group_size} channels do not fall on the "
                                        f"tensor_parallel_size ({self.tp.size}) ranks' {local} channels each")
        self.group_size = group_size
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(local, dtype=dtype, device=device), requires_grad=False)

    def load_weight(self, param_name: str, tensor: Weight, shard: str | None = None) -> None:
        if param_name != "weight":
            raise ValueError(f"{param_name}: the gated norm has only a weight")
        _load_rows(self.weight, tensor, self.start, self.full_size)

    def forward(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        dtype = y.dtype
        h = y.float() * F.silu(z.float())
        if self.spans_ranks:
            squares = self.tp.all_reduce(h.pow(2).sum(-1, keepdim=True))
            return self.weight * (h * torch.rsqrt(squares / self.group_size + self.eps)).to(dtype)
        groups = h.view(*h.shape[:-1], -1, self.group_size)
        normed = groups * torch.rsqrt(groups.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.view(h.shape).to(dtype)


class Mamba2InProj(MergedLinear):
    """in_proj: column-parallel over the five segments of its one checkpoint tensor, z, x, B, C, dt (`segments`:
    name -> (first checkpoint row this rank holds, rows held, checkpoint rows), in checkpoint order); each rank's
    output is its rows of each, stacked in that order. Loaded and keyed as a plain layer: load_weight cuts the
    checkpoint tensor into the segments, each of which gives the rank its rows (all of a replicated B / C).

    Under an FP8 checkpoint method (ModelOpt's FP8 Nemotron releases: `in_proj.weight` E4M3, `weight_scale`,
    `input_scale`) the codes are cut the same way; a per-tensor weight_scale applies to every segment (each
    segment's rows take it), a per-channel one is cut as the rows are, and the one static input_scale is the
    layer's."""

    def __init__(self, in_features: int, segments: dict[str, tuple[int, int, int]], *, bias: bool,
                 dtype: torch.dtype, device: Any):
        self._init_shards(in_features, segments, bias=bias, dtype=dtype, device=device)

    def checkpoint_keys(self, name: str) -> set[str]:
        method = self.weight_method
        leaves = ["weight"] if method is None or method.float_weight else list(method.checkpoint_params)
        return {f"{name}.{leaf}" for leaf in (*leaves, *(("bias",) if self.bias is not None else ()))}

    def load_weight(self, param_name: str, tensor: Weight, shard: str | None = None) -> None:
        if shard is not None:
            super().load_weight(param_name, tensor, shard)
            return
        method = self.weight_method if self._method_takes(param_name) else None
        if method is None and (param_name not in ("weight", "bias")
                               or not isinstance(tensor, (torch.Tensor, CheckpointSlice))):
            raise ValueError(f"{param_name}: the Mamba2 in_proj takes a float weight (and bias) only, or the tensors "
                             "of its quantization method")
        full = sum(rows for _, _, rows in self.checkpoint_rows.values())
        shape = shape_of(tensor)
        if method is not None and (param_name == "input_scale" or math.prod(shape) == 1):
            # (one value for the whole layer: the static input scale, or a per-tensor weight scale for each segment)
            for segment in self.checkpoint_rows if param_name != "input_scale" else (None,):
                method.load(self, param_name, tensor, segment)
            return
        if not shape or shape[0] != full:
            raise ValueError(f"checkpoint shape {shape}, model expects {full} rows (z, x, B, C, dt)")
        start = 0
        for segment, (_, _, rows) in self.checkpoint_rows.items():
            if method is not None:
                method.load(self, param_name, row_block(tensor, start, rows), segment)
            else:
                self.load_shard(param_name, segment, row_block(tensor, start, rows))
            start += rows


class Mamba2Conv(nn.Module):
    """The depthwise causal conv's kernel [channels, W] and bias [channels] (a module so the checkpoint names are
    conv1d.weight / conv1d.bias; the checkpoint's [C, 1, W] kernel is read as [C, W]). parts: (first checkpoint
    channel, channels) of each block this rank holds (its x, B and C channels), stacked in order."""

    def __init__(self, parts: list[tuple[int, int]], checkpoint_channels: int, width: int, bias: bool,
                 dtype: torch.dtype, device: Any):
        super().__init__()
        self.parts = parts
        self.checkpoint_channels = checkpoint_channels
        channels = sum(length for _, length in parts)
        self.weight = nn.Parameter(torch.empty(channels, width, dtype=dtype, device=device), requires_grad=False)
        self.bias = (nn.Parameter(torch.empty(channels, dtype=dtype, device=device), requires_grad=False)
                     if bias else None)

    def load_weight(self, param_name: str, tensor: Weight, shard: str | None = None) -> None:
        param = {"weight": self.weight, "bias": self.bias}.get(param_name)
        if param is None:
            raise ValueError(f"{param_name}: the conv has a weight" + (" and a bias" if self.bias is not None else ""))
        value = materialize(tensor)
        if param_name == "weight" and value.dim() == 3:
            value = value.reshape(value.shape[0], -1)
        want = (self.checkpoint_channels, *param.shape[1:])
        if tuple(value.shape) != want:
            raise ValueError(f"checkpoint shape {tuple(value.shape)}, model expects {want}")
        param.data.copy_(torch.cat([value[start:start + length] for start, length in self.parts]))


class Mamba2Mixer(nn.Module):
    def __init__(self, hidden_size: int, *, num_heads: int, head_dim: int, n_groups: int, d_state: int,
                 conv_kernel: int, conv_bias: bool, proj_bias: bool, eps: float,
                 time_step_limit: tuple[float, float] = (0.0, math.inf), activation: str = "silu",
                 dtype: torch.dtype, device: Any, ops: DeviceOps | None = None):
        """ops: the model's op set (layers/ops.py), chosen once when the model is built: the Triton set (CUDA, or
        the interpreter in tests) takes the scan's kernels (layers/mamba2_ssm.py), any other the torch path.
        Head and group counts are the checkpoint's; the layer holds this rank's share (module docstring)."""
        super().__init__()
        if activation not in ("silu", "swish"):
            raise UnsupportedModelError(f"config.json: the Mamba2 layers' activation {activation!r} is not supported "
                                        "(only silu)")
        if num_heads % n_groups:
            raise UnsupportedModelError(f"config.json: mamba_n_heads {num_heads} is not a multiple of mamba_n_groups "
                                        f"{n_groups}")
        tp = get_tp_group()
        self.head_start, heads = even_split(num_heads, tp.size, tp.rank, "the Mamba2 heads")
        group_start, groups = mamba2_group_range(n_groups, tp.size, tp.rank, "the Mamba2 groups (n_groups)")
        self.ops = ops if ops is not None else for_device(device)
        self.cuda_kernels = isinstance(self.ops, TritonOps)
        self.checkpoint_heads = num_heads
        self.num_heads, self.head_dim, self.n_groups, self.d_state = heads, head_dim, groups, d_state
        self.intermediate_size = heads * head_dim
        self.conv_dim = self.intermediate_size + 2 * groups * d_state
        self.conv_kernel = conv_kernel
        self.time_step_limit = (float(time_step_limit[0]), float(time_step_limit[1]))
        inner, bc = num_heads * head_dim, n_groups * d_state  # (the checkpoint's)
        x_rows = (self.head_start * head_dim, self.intermediate_size, inner)
        bc_rows = (group_start * d_state, groups * d_state, bc)
        self.in_proj = Mamba2InProj(hidden_size, {"z": x_rows, "x": x_rows, "B": bc_rows, "C": bc_rows,
                                                  "dt": (self.head_start, heads, num_heads)},
                                    bias=proj_bias, dtype=dtype, device=device)
        self.conv1d = Mamba2Conv([(x_rows[0], x_rows[1]), (inner + bc_rows[0], bc_rows[1]),
                                  (inner + bc + bc_rows[0], bc_rows[1])], inner + 2 * bc, conv_kernel, conv_bias,
                                 dtype, device)
        # (float32 as transformers keeps them: exp(A_log) and softplus(dt + dt_bias) make the decay's log)
        self.A_log = nn.Parameter(torch.empty(heads, dtype=torch.float32, device=device), requires_grad=False)
        self.dt_bias = nn.Parameter(torch.empty(heads, dtype=torch.float32, device=device), requires_grad=False)
        self.D = nn.Parameter(torch.empty(heads, dtype=torch.float32, device=device), requires_grad=False)
        self.norm = GroupedGatedRMSNorm(inner, inner // n_groups, eps, dtype, device)
        self.out_proj = RowParallelLinear(inner, hidden_size, bias=proj_bias, dtype=dtype, device=device)
        self.conv_states: torch.Tensor | None = None
        self.ssm_states: torch.Tensor | None = None

    def load_weight(self, param_name: str, tensor: Weight, shard: str | None = None) -> None:
        """A_log / dt_bias / D [heads] (the checkpoint's): this rank's heads (models/load_check.load_into)."""
        param = {"A_log": self.A_log, "dt_bias": self.dt_bias, "D": self.D}.get(param_name)
        if param is None:
            raise ValueError(f"{param_name}: not a parameter of the Mamba2 mixer itself")
        _load_rows(param, tensor, self.head_start, self.checkpoint_heads)

    # ---- worker/recurrent_states.py ----------------------------------------------------------------
    def state_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """One request's (conv state, SSM state) on this rank: [conv_dim, W-1] and [heads, d_state, head_dim]."""
        return (self.conv_dim, self.conv_kernel - 1), (self.num_heads, self.d_state, self.head_dim)

    def bind_states(self, conv_states: torch.Tensor, ssm_states: torch.Tensor) -> None:
        self.conv_states, self.ssm_states = conv_states, ssm_states

    def forward(self, x: torch.Tensor, meta: Any, step: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]. step: step_state_rows(meta), computed once per forward."""
        if self.conv_states is None or self.ssm_states is None:
            raise RuntimeError("Mamba2Mixer: no recurrent states bound (worker/recurrent_states.py)")
        t = x.shape[0]
        rows, has_state = step
        h, p, g, n = self.num_heads, self.head_dim, self.n_groups, self.d_state
        z, xbc, dt = self.in_proj(x).split([self.intermediate_size, self.conv_dim, h], dim=-1)
        xbc = self.ops.causal_conv1d(xbc, self.conv1d.weight, self.conv1d.bias, self.conv_states, rows,
                                     meta.query_start_loc, meta.query_start_loc_cpu, has_state, activation="silu",
                                     decode_only=meta.decode_only, draft_rows=meta.draft_state_rows,
                                     max_query_len=meta.max_query_len, live_lens=meta.live_query_lens)
        xs, b, c = xbc.split([self.intermediate_size, g * n, g * n], dim=-1)
        dt = F.softplus(dt.float() + self.dt_bias)
        lo, hi = self.time_step_limit
        if lo > 0.0 or hi < math.inf:
            dt = dt.clamp(min=lo, max=hi)
        y = mamba2_ssm_varlen(xs.reshape(t, h, p), dt, -torch.exp(self.A_log), b.reshape(t, g, n),
                              c.reshape(t, g, n), self.D, self.ssm_states, rows, meta.query_start_loc,
                              meta.query_start_loc_cpu, has_state, decode_only=meta.decode_only,
                              cuda_kernels=self.cuda_kernels, draft_rows=meta.draft_state_rows,
                              max_query_len=meta.max_query_len, live_lens=meta.live_query_lens)
        return self.out_proj(self.norm(y.reshape(t, self.intermediate_size), z))
