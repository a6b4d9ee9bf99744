"""What AWQ and GPTQ checkpoints share: 4-bit codes in int32 words, a scale and a zero point per group
of input columns, and one runner, `Int4Linear`, holding the layout the kernels read
(kernels/int4_matmul.py). Each format only says how its tensors lie (awq.py, gptq.py); this module
takes this rank's part of them, unpacks them to codes, and packs every format the same way.

Act-order (GPTQ desc_act, a g_idx that is not k // group_size): the input columns are reordered once
at load so that each group's columns are contiguous (a stable sort by g_idx), and x is gathered into
that order on every call (`x[:, perm]`, one small gather per projection). The alternative, a group
index per k read inside the kernel, would cost two gathers per weight in the decode GEMV's inner loop
(a scale and a zero per nibble instead of per block), where the GEMV has no instruction to spare;
the gather of x is M x K elements once per call.

On CUDA the runner calls the Triton kernels. Anywhere else it dequantizes the weight once, when the
layer is finalized, and runs F.linear: int4 on the CPU exists for tests (the CPU's quantized path
is GGUF, layers/quant/int4_weight.py).

One-token steps: a runner on the kernels without act-order lets its layer take the fused one-token
decode path (`Int4LinearMethod.fused_decode`; attention/fused_decode.py reads the packed weight
from `Linear.quant` and runs the int4 GEMV with the input norm in its prologue and SiLU or the
residual add in its epilogue). Act-order layers keep the general path: every projection's x would
need its gather, and the two normed ones the norm weight's too (the RMS statistic does not care
about the order, the weight does), up to 6 launches a layer against the ~4 the fused path saves
(6 instead of ~10), for the least common int4 layout (desc_act; refused under tensor parallelism).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from ferrox.distributed.sharding import Weight, materialize, narrow, shape_of
from ferrox.layers.quant.method import LinearWeightMethod
from ferrox.model_spec import ModelSpec, UnsupportedModelError

if TYPE_CHECKING:
    from ferrox.kernels.int4_matmul import Int4Weights
    from ferrox.layers.linear import Linear

# AWQ's GEMM layout packs the 8 output columns of a word in the order 0, 2, 4, 6, 1, 3, 5, 7 (its CUDA
# kernel's dequantize wants them so): column c sits in nibble AWQ_NIBBLE_OF_COLUMN[c].
AWQ_NIBBLE_OF_COLUMN = (0, 4, 1, 5, 2, 6, 3, 7)
SEQUENTIAL = tuple(range(8))


# ---- nibbles ------------------------------------------------------------------------------------------
def unpack_nibbles(words: torch.Tensor, dim: int, nibble_of: Sequence[int] = SEQUENTIAL) -> torch.Tensor:
    """int32 words -> uint8 codes 0..15, 8 per word along `dim` (that dim grows 8x); the i-th code of
    a word is in its nibble nibble_of[i]."""
    shifts = torch.tensor([4 * s for s in nibble_of], dtype=torch.int32, device=words.device)
    moved = words.to(torch.int32).movedim(dim, -1)
    codes = (moved.unsqueeze(-1) >> shifts) & 0xF
    return codes.flatten(-2).movedim(-1, dim).to(torch.uint8)


def pack_nibbles(codes: torch.Tensor, dim: int, nibble_of: Sequence[int] = SEQUENTIAL) -> torch.Tensor:
    """The inverse of unpack_nibbles: uint8 codes (0..15) along `dim` -> int32 words."""
    moved = codes.to(torch.int32).movedim(dim, -1)
    moved = moved.reshape(*moved.shape[:-1], moved.shape[-1] // 8, 8)
    words = torch.zeros(moved.shape[:-1], dtype=torch.int32, device=codes.device)
    for i, nibble in enumerate(nibble_of):
        words |= moved[..., i] << (4 * nibble)
    return words.movedim(-1, dim).contiguous()


def pack_interleaved(codes: torch.Tensor, interleave: int) -> torch.Tensor:
    """uint8 codes [N, K] -> the kernels' int32 [N, K/8] (word i of block b, nibble j: k = 8T b + T j + i)."""
    n, k = codes.shape
    blocks = codes.reshape(n, k // (8 * interleave), 8, interleave).transpose(2, 3)  # [n, b, i, j]
    return pack_nibbles(blocks.reshape(n, k), 1)


# ---- one shard as the formats describe it ---------------------------------------------------------------
@dataclass(slots=True)
class Int4Shard:
    """One shard's weight (rows of the layer's output), format-neutral: codes in checkpoint k order."""

    codes: torch.Tensor  # uint8 [rows, K]
    scales: torch.Tensor  # [G, rows]
    zeros: torch.Tensor  # uint8 [G, rows], the true zero points
    g_idx: torch.Tensor | None = None  # int [K]: the group of each input column (None: k // group_size)


def dequantize_codes(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int) -> torch.Tensor:
    """float32 [rows, K]: (codes - zeros) * scales, column k in group k // group."""
    g = torch.arange(codes.shape[1], device=codes.device) // group
    return (codes.float() - zeros.float()[g].t()) * scales.float()[g].t()


def _same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is b
    return a.shape == b.shape and bool(torch.equal(a, b))


def act_order(g_idx: torch.Tensor | None, group: int, k: int, what: str) -> torch.Tensor | None:
    """The input-column order that makes each group contiguous (None: already k // group_size)."""
    if g_idx is None:
        return None
    g_idx = g_idx.to(torch.int64)
    natural = torch.arange(k, device=g_idx.device) // group
    if torch.equal(g_idx, natural):
        return None
    perm = torch.sort(g_idx, stable=True).indices
    if not torch.equal(g_idx[perm], natural):
        raise ValueError(f"{what}: g_idx does not give every group {group} input columns (not a GPTQ act-order "
                         "index)")
    return perm


class Int4Linear(nn.Module):
    """The runner of an int4 layer: forward(x, bias) = x @ W.T + bias, W in groups along the input:
    W[n, k] = (q[n, k] - zeros[g, n]) * scales[g, n], g = k // group_size (codes [N, K], scales and
    zeros [G, N] as the checkpoints orient them; k in the act-order column order `perm` when there is
    one). kernels=False keeps W dequantized in `dtype` instead."""

    packed: torch.Tensor  # (the kernels' layout, kernels=True)
    mma: torch.Tensor | None  # the codes again, for 1-16 token products on tensor cores (kernels/int4_gemv_cuda.py)
    scales: torch.Tensor
    zeros: torch.Tensor
    perm: torch.Tensor | None
    weight: torch.Tensor | None  # W [N, K] in the model dtype (kernels=False)

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
                 perm: torch.Tensor | None, *, dtype: torch.dtype, kernels: bool):
        super().__init__()
        from ferrox.kernels.int4_matmul import interleave_words  # (pure Python; the kernels import triton)

        self.out_features, self.in_features = codes.shape
        self.group_size = min(group_size, self.in_features)
        self.kernels = kernels
        self.interleave = interleave_words(self.in_features, self.group_size)
        self.act_order = perm is not None
        if kernels:
            self.register_buffer("packed", pack_interleaved(codes, self.interleave))
            self.register_buffer("scales", scales.t().contiguous())  # the kernels' [N, G]
            self.register_buffer("zeros", zeros.t().contiguous())
            self.register_buffer("perm", perm)
            self.register_buffer("weight", None)
            self.register_buffer("mma", _mma_layout(codes, self.scales, self.zeros, self.group_size))
            self.weights().check()
        else:
            w = dequantize_codes(codes, scales, zeros, self.group_size)
            if perm is not None:  # back to checkpoint column order: x needs no gather
                w = torch.empty_like(w).index_copy_(1, perm, w)
            self.register_buffer("weight", w.to(dtype))
            for name in ("packed", "scales", "zeros", "perm", "mma"):
                self.register_buffer(name, None)

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features}, group={self.group_size}, "
                f"act_order={self.act_order}, kernels={self.kernels}")

    def weights(self) -> Int4Weights:
        from ferrox.kernels.int4_matmul import Int4Weights

        return Int4Weights(self.packed, self.scales, self.zeros, self.group_size, self.interleave, self.mma)

    def fused_decode_weights(self) -> Int4Weights:
        """The packed weight for the fused one-token kernels (attention/fused_decode.py), which read
        it in checkpoint column order on the kernels' layout only."""
        if not self.kernels or self.act_order:  # Int4LinearMethod.fused_decode keeps these off that path
            raise ValueError(f"an int4 layer ({self.extra_repr()}) the fused one-token kernels cannot read: "
                             "its model takes the general path")
        return self.weights()

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.weight is not None:
            return F.linear(x, self.weight, bias)
        from ferrox.kernels.int4_matmul import int4_linear  # (imported, hence cached, when built)

        if x.shape[-1] != self.in_features:
            raise ValueError(f"x has {x.shape[-1]} features, the layer {self.in_features}")
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        x2 = x2.index_select(1, self.perm) if self.perm is not None else x2.contiguous()
        return int4_linear(x2, self.weights(), bias).reshape(*lead, self.out_features)


def _mma_layout(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int) -> torch.Tensor | None:
    """The tensor-core kernel's stream (int4_gemv_cuda.pack_mma: the codes again, with each group's scales
    and zero points; scales, zeros [N, G]) where that kernel can run, else None. Packed a band of row tiles
    at a time: the repacking's int64 temporaries are 8x the codes."""
    from ferrox.kernels import int4_gemv_cuda

    n, k = codes.shape
    group = min(group, k)
    if not codes.is_cuda or not int4_gemv_cuda.enabled() or int4_gemv_cuda.stream_problem(n, k, group, scales, zeros):
        return None
    band = 16 * 256
    return torch.cat([int4_gemv_cuda.pack_mma(codes[i:i + band], scales[i:i + band], zeros[i:i + band], group)
                      for i in range(0, n, band)])


def build_int4_linear(shards: Sequence[Int4Shard], group_size: int, *, dtype: torch.dtype, what: str) -> Int4Linear:
    """Shards (in output-row order) -> one runner; the shards of a merged layer share their input, so
    their act-order (g_idx) must agree."""
    first = shards[0]
    for shard in shards[1:]:
        if not _same(shard.g_idx, first.g_idx):
            raise ValueError(f"{what}: the merged shards carry different g_idx (act-order differs between "
                             "projections of one input; ferrox runs them as one matmul)")
    codes = torch.cat([s.codes for s in shards]) if len(shards) > 1 else first.codes
    scales = torch.cat([s.scales for s in shards], dim=1) if len(shards) > 1 else first.scales
    zeros = torch.cat([s.zeros for s in shards], dim=1) if len(shards) > 1 else first.zeros
    k = codes.shape[1]
    group = min(group_size, k)
    perm = act_order(first.g_idx, group, k, what)
    if perm is not None:
        codes = codes.index_select(1, perm)
    kernels = codes.device.type == "cuda"
    return Int4Linear(codes, scales, zeros, group, perm, dtype=dtype, kernels=kernels)


# ---- checkpoint tensors -> this rank's part -------------------------------------------------------------
class TensorLayout(NamedTuple):
    """How a checkpoint tensor of a linear layer lies: which dim runs over the input (in units of
    one column "k", a packed word of 8 "k8", or a "group"), and which over the output (packed 8 to a
    word or not)."""

    in_dim: int
    in_unit: Literal["k", "k8", "group"]
    out_dim: int | None  # None: the tensor has no output dim (g_idx)
    out_packed: bool = False


def _geometry(layer: Linear, shard: str | None) -> tuple[int, int, int, int, int, int]:
    """(first checkpoint row, rows held, checkpoint rows, first checkpoint column, columns held,
    checkpoint columns) of this rank's part of `layer` (shard of a merged layer)."""
    k_local = layer.in_features
    in_start = int(getattr(layer, "in_start", 0))
    k_full = k_local * layer.tp.size if hasattr(layer, "in_start") else k_local
    rows_info = getattr(layer, "checkpoint_rows", None)
    if rows_info is not None and shard is not None:
        start, held, full = rows_info[shard]
    else:
        start, held, full = 0, layer.out_features, layer.out_features
    return start, held, full, in_start, k_local, k_full


def checkpoint_extent(layer: Linear, shard: str | None) -> tuple[int, int]:
    """(output rows, input columns) of `shard`'s whole checkpoint weight, before any rank's split."""
    _, _, full, _, _, k_full = _geometry(layer, shard)
    return full, k_full


def _units(in_unit: str, group: int, k_full: int) -> int:
    return {"k": 1, "k8": 8, "group": group if group < k_full else k_full}[in_unit]


def rank_part(tensor: Weight, lay: TensorLayout, layer: Linear, shard: str | None, group_size: int,
              param: str) -> torch.Tensor:
    """This rank's part of a checkpoint tensor: its rows of the shard's output (column parallel) and
    its input columns (row parallel), checked against the shapes the layer expects."""
    start, held, full, in_start, k_local, k_full = _geometry(layer, shard)
    group = group_size if 0 < group_size < k_full else k_full
    in_unit = _units(lay.in_unit, group, k_full)
    out_unit = 8 if lay.out_packed else 1
    expected = [0, 0][: 2 if lay.out_dim is not None else 1]
    expected[lay.in_dim] = -(-k_full // in_unit)
    if lay.out_dim is not None:
        expected[lay.out_dim] = full // out_unit
    if full % out_unit or shape_of(tensor) != tuple(expected):
        raise ValueError(f"{param}: checkpoint shape {shape_of(tensor)}, expected {tuple(expected)} for "
                         f"{k_full} inputs x {full} outputs (group {group})")
    part: Weight = tensor
    if lay.out_dim is not None and held != full:
        if start % out_unit or held % out_unit:
            raise ValueError(f"{param}: this rank's output rows [{start}, {start + held}) do not fall on whole "
                             f"packed words of {out_unit}")
        part = narrow(part, lay.out_dim, start // out_unit, held // out_unit)
    if k_local != k_full and not (lay.in_unit == "group" and group >= k_full):
        if in_start % in_unit or k_local % in_unit:
            raise ValueError(f"{param}: this rank's input columns [{in_start}, {in_start + k_local}) do not fall "
                             f"on whole units of {in_unit}")
        part = narrow(part, lay.in_dim, in_start // in_unit, k_local // in_unit)
    return materialize(part)


# ---- the method both formats share ---------------------------------------------------------------------
class Int4LinearMethod(LinearWeightMethod):
    """Collects a layer's checkpoint tensors per shard (this rank's part, on the layer's device) and
    at finalize turns each shard into an `Int4Shard` (`to_shard`, per format) and all into one runner."""

    layouts: dict[str, TensorLayout] = {}
    # The checkpoint's act-order index (the group of each input column), if the format has one.
    g_idx_param: str | None = None
    # Set by finalize: the fused one-token path runs the layer when its runner is on the kernels
    # and has no act-order (the module docstring says why); the CPU's dequantized runner keeps
    # the general path.
    fused_decode = False

    def __init__(self, group_size: int):
        self.group_size = group_size
        self._tensors: dict[str, dict[str, torch.Tensor]] = {}
        self._shards: dict[str, Int4Shard] = {}

    def to_shard(self, tensors: dict[str, torch.Tensor], rows: int, k: int) -> Int4Shard:
        raise NotImplementedError

    def group_of(self, layer: Linear) -> int:
        k_full = _geometry(layer, None)[5]
        return self.group_size if 0 < self.group_size < k_full else k_full

    def load(self, layer: Linear, param_name: str, tensor: Weight, shard: str | None) -> None:
        part = rank_part(tensor, self.layouts[param_name], layer, shard, self.group_size, param_name)
        self._tensors.setdefault(shard or "weight", {})[param_name] = part.to(layer.weight.device)
        if param_name == self.g_idx_param:
            self._take_g_idx(layer, param_name, shard)

    def _take_g_idx(self, layer: Linear, param_name: str, shard: str | None) -> None:
        from ferrox.layers.linear import RowParallelLinear

        part = self._tensors[shard or "weight"]
        if isinstance(layer, RowParallelLinear) and layer.tp.size > 1:
            # A row-parallel rank holds input columns from in_start on: its groups count from there.
            part[param_name] = part[param_name] - layer.in_start // self.group_of(layer)
        # Checked here, where the loader's error names the tensor: an act-order index, and one order for
        # every shard of a merged layer (they read one input, so GPTQ sorted them alike).
        act_order(part[param_name], self.group_of(layer), layer.in_features, param_name)
        for other, tensors in self._tensors.items():
            if other != (shard or "weight") and param_name in tensors and not torch.equal(tensors[param_name],
                                                                                          part[param_name]):
                raise ValueError(f"{param_name} differs from shard {other!r}'s: ferrox runs a merged layer's shards "
                                 "as one matmul, with one act-order")

    def dummy(self, layer: Linear, seed: int) -> None:
        """Random codes, zero points 8 and scales ~0.0043, so weights have std ~0.02 like the float
        dummy weights (uniform codes 0..15 minus 8 have std ~4.6)."""
        device = layer.weight.device
        gen = torch.Generator(device=device).manual_seed(seed)
        k = layer.in_features
        groups = -(-k // min(self.group_of(layer), k))
        for name, (_, rows) in layer._shard_rows().items():
            codes = torch.randint(0, 16, (rows, k), generator=gen, device=device, dtype=torch.uint8)
            scales = (0.02 / 4.6) * (0.75 + 0.5 * torch.rand(groups, rows, generator=gen, device=device))
            zeros = torch.full((groups, rows), 8, dtype=torch.uint8, device=device)
            self._shards[name] = Int4Shard(codes, scales.to(torch.float16), zeros)

    def finalize(self, layer: Linear) -> nn.Module:
        shards = []
        for name, (_, rows) in layer._shard_rows().items():
            if name not in self._shards:
                tensors = self._tensors.pop(name, {})
                missing = [p for p in self.checkpoint_params if p not in tensors]
                if missing:
                    raise ValueError(f"shard {name!r}: checkpoint tensors {missing} never arrived")
                self._shards[name] = self.to_shard(tensors, rows, layer.in_features)
            shards.append(self._shards.pop(name))
        what = f"{type(self).__name__} layer ({layer.in_features} -> {layer.out_features})"
        runner = build_int4_linear(shards, self.group_of(layer), dtype=layer.weight.dtype, what=what)
        self.fused_decode = runner.kernels and not runner.act_order
        return runner


# ---- shapes a model must have ---------------------------------------------------------------------------
def check_int4_shapes(spec: ModelSpec, tp_size: int, group_size: int, method: str) -> None:
    """Refuse, naming the numbers, a model whose projections cannot hold int4 words and groups: every
    input width divisible by 32 (the kernels' blocks; split across ranks along whole groups), every
    rank's output rows by 8 (AWQ packs them; both formats pack the zero points so)."""
    from ferrox.distributed.sharding import local_num_kv_heads

    q_rows = spec.num_heads * spec.head_dim // tp_size
    kv_rows = local_num_kv_heads(spec, tp_size) * spec.head_dim
    outputs = {"q_proj rows": q_rows, "k/v_proj rows": kv_rows, "o_proj rows": spec.hidden_size,
               "gate/up_proj rows": spec.intermediate_size // tp_size, "down_proj rows": spec.hidden_size}
    for what, rows in outputs.items():
        if rows % 8:
            raise UnsupportedModelError(f"{method}: {what} per rank ({rows}) is not divisible by 8 (int4 words)")
    inputs = {"hidden_size": (spec.hidden_size, 1), "o_proj inputs": (spec.num_heads * spec.head_dim, tp_size),
              "intermediate_size": (spec.intermediate_size, tp_size)}
    for what, (k, split) in inputs.items():
        local = k // split
        if local % 32:
            raise UnsupportedModelError(f"{method}: {what} per rank ({local}) is not divisible by 32 (int4 blocks)")
        if split > 1 and 0 < group_size < k and local % group_size:
            raise UnsupportedModelError(f"{method}: {what} ({k}) split over tensor_parallel_size={tp_size} gives "
                                        f"{local} columns per rank, not whole groups of group_size={group_size}")
