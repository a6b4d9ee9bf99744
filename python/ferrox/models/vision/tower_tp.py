"""A vision tower's weights sharded over the tensor-parallel ranks (vLLM's --mm-encoder-tp-mode weights).

The towers (vit.py, pixtral_vision.py, qwen2_vl_vision.py, qwen3_vl_vision.py, intern_vit.py) are built and
loaded whole with plain nn layers; a tower that runs sharded then names its transformer blocks
(`tp_blocks()`) and `shard_tower` swaps each block's projections for the language model's parallel layers,
Megatron-style, keeping this rank's part of the loaded weights:

    attention: q, k, v (one fused layer or three) column-parallel by heads (this rank's heads), the output
               projection row-parallel (partial products summed by one all-reduce, its bias added once);
               an RMSNorm over the whole q or k (InternViT-6B's qk norms) keeps its slice and sums the squares
               over the ranks
    MLP:       the up projections (fc1, or gate and up) column-parallel, the down projection row-parallel

so each rank holds 1/N of the blocks' matrices and every rank runs every image (two all-reduces a block).
Embeddings, norms between blocks and the mergers / projectors after the tower stay whole. The whole tower is
read first (its tensors are small beside the language model's) and the parts not kept are freed at once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ferrox.distributed.parallel_state import TPGroup, use_tp_group
from ferrox.layers.linear import MergedLinear, RowParallelLinear


@dataclass(slots=True)
class TowerBlock:
    """One transformer block of a tower, by the names of its layers."""

    attention: Any  # an nn.Module with num_heads, which becomes this rank's
    qkv: tuple[str, ...]  # one fused layer (q, k, v rows stacked) or the three
    out: str
    mlp: Any  # an nn.Module
    up: tuple[str, ...]  # the column-parallel projections
    down: str
    qk_norms: tuple[str, ...] = ()  # RMSNorms over the whole q / k width, if any


def tower_tp_problem(blocks: list[TowerBlock], size: int, tower: str) -> str | None:
    """Why the blocks cannot be sharded `size` ways (their heads or an MLP width do not split), or None."""
    for block in blocks:
        heads = int(block.attention.num_heads)
        if heads % size:
            return f"the {tower}'s {heads} attention heads do not split {size} ways"
        for name in block.up:
            width = getattr(block.mlp, name).out_features
            if width % size:
                return f"the {tower}'s MLP width {width} does not split {size} ways"
    return None


def shard_tower(blocks: list[TowerBlock], tp: TPGroup) -> None:
    """Swap the blocks' projections (loaded whole) for this rank's parallel layers (module docstring)."""
    with use_tp_group(tp), torch.no_grad():
        for block in blocks:
            attn = block.attention
            if len(block.qkv) == 1:
                _swap(attn, block.qkv[0], _column(getattr(attn, block.qkv[0]), ("q", "k", "v")))
            else:
                for name in block.qkv:
                    _swap(attn, name, _column(getattr(attn, name)))
            _swap(attn, block.out, _row(getattr(attn, block.out)))
            for name in block.qk_norms:
                _swap(attn, name, ShardedRMSNorm(getattr(attn, name), tp))
            attn.num_heads = int(attn.num_heads) // tp.size
            for name in block.up:
                _swap(block.mlp, name, _column(getattr(block.mlp, name)))
            _swap(block.mlp, block.down, _row(getattr(block.mlp, block.down)))


def _swap(parent: nn.Module, name: str, module: nn.Module) -> None:
    setattr(parent, name, module)


def _column(linear: nn.Linear, parts: tuple[str, ...] = ("rows",)) -> MergedLinear:
    """This rank's rows of each of `parts` equal row blocks of a loaded layer (built in the current TP group)."""
    out = linear.out_features // len(parts)
    layer = MergedLinear(linear.in_features, dict.fromkeys(parts, out), bias=linear.bias is not None,
                         dtype=linear.weight.dtype, device=linear.weight.device)
    for k, part in enumerate(parts):
        layer.load_weight("weight", linear.weight[k * out:(k + 1) * out], part)
        if linear.bias is not None:
            layer.load_weight("bias", linear.bias[k * out:(k + 1) * out], part)
    return layer


def _row(linear: nn.Linear) -> RowParallelLinear:
    """This rank's input columns of a loaded layer; its output summed over the ranks, the bias added once."""
    layer = RowParallelLinear(linear.in_features, linear.out_features, bias=linear.bias is not None,
                              dtype=linear.weight.dtype, device=linear.weight.device)
    layer.load_weight("weight", linear.weight)
    if linear.bias is not None:
        layer.load_weight("bias", linear.bias)
    return layer


class ShardedRMSNorm(nn.Module):
    """An RMSNorm over a width the ranks split (q or k before the heads split): this rank's slice of the
    weight; the mean square is summed over the ranks, so each rank normalizes by the whole row's."""

    def __init__(self, norm: Any, tp: TPGroup) -> None:
        super().__init__()
        weight = norm.weight
        self.full = int(weight.shape[0])
        local = self.full // tp.size
        self.weight = nn.Parameter(weight.detach()[tp.rank * local:(tp.rank + 1) * local].clone(),
                                   requires_grad=False)
        self.eps = float(norm.eps)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        squares = self.tp.all_reduce(x32.pow(2).sum(-1, keepdim=True))
        return self.weight * (x32 * torch.rsqrt(squares / self.full + self.eps)).to(x.dtype)
