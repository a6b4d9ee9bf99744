"""Tensor-parallel layer shards in one process, for the quantized-checkpoint tests: the same tiny
layers (merged q/k/v, merged gate/up, row-parallel down) built whole and as two ranks, loaded from
one safetensors file (the ranks through lazy slices, as the engine's sharded load reads), and the
two ranks' outputs put back together (column-parallel outputs concatenated per shard, row-parallel
partial products summed)."""

from __future__ import annotations

import torch
from ferrox.distributed.parallel_state import TPGroup, use_tp_group
from ferrox.distributed.sharding import CheckpointSlice
from ferrox.layers.linear import Linear, MergedLinear, QKVLinear, RowParallelLinear
from ferrox.layers.quant.method import QuantConfig, use_quant_config
from safetensors import safe_open
from safetensors.torch import save_file

# Each kind's shards (checkpoint rows); a tensor of a shard is named "<shard>.<leaf>" ("<leaf>" for down).
SHARDS = {"qkv": {"q": 64, "k": 32, "v": 32}, "gate_up": {"gate": 128, "up": 128}, "down": {None: 64}}
# The order leaves load in (a packed weight's shape may follow it; biases only where the layer has one).
_LEAVES = ("weight", "weight_packed", "weight_shape", "weight_scale", "weight_scale_inv", "input_scale",
           "weight_zero_point", "bias")


def tp_layer(kind: str, rank: int, size: int, config: QuantConfig | None) -> Linear:
    """Rank `rank` of `size` of layer `kind`, quantized by `config`."""
    with use_tp_group(TPGroup(rank=rank, size=size)), use_quant_config(config):
        if kind == "qkv":
            return QKVLinear(64, 4, 2, 16, bias=True, dtype=torch.float32)
        if kind == "gate_up":
            return MergedLinear(64, {"gate": 128, "up": 128}, bias=False, dtype=torch.float32)
        return RowParallelLinear(128, 64, bias=True, dtype=torch.float32)


def load_layer(layer: Linear, kind: str, tensors: dict[str, object]) -> None:
    """Every tensor of every shard the layer takes, then its quantized runner."""
    for shard in SHARDS[kind]:
        prefix = f"{shard}." if shard else ""
        for leaf in _LEAVES:
            if f"{prefix}{leaf}" in tensors and (leaf != "bias" or layer.bias is not None):
                layer.load_weight(leaf, tensors[f"{prefix}{leaf}"], shard)  # type: ignore[arg-type]
    layer.finalize_quantized()


def whole_and_ranks(kind: str, config: QuantConfig | None, tensors: dict[str, torch.Tensor],
                    path) -> tuple[Linear, list[Linear]]:
    """The whole layer loaded from `tensors`, and two ranks loaded from them written to `path`."""
    save_file(tensors, path)
    whole = tp_layer(kind, 0, 1, config)
    load_layer(whole, kind, tensors)  # type: ignore[arg-type]
    ranks = [tp_layer(kind, r, 2, config) for r in range(2)]
    with safe_open(path, framework="pt") as f:
        for layer in ranks:
            load_layer(layer, kind, {name: CheckpointSlice(f.get_slice(name)) for name in f.keys()})
    return whole, ranks


def ranks_output(kind: str, ranks: list[Linear], x: torch.Tensor) -> torch.Tensor:
    """The two ranks' outputs as the whole layer's: each shard's rows concatenated, or (down) the
    ranks' partial products of their input columns summed, rank 0's with the bias."""
    if kind == "down":
        parts = [layer.quant(x[:, layer.in_start:layer.in_start + layer.in_features],
                             layer.bias if layer.adds_bias else None) for layer in ranks]
        return parts[0] + parts[1]
    outs = [layer(x).split(list(layer.shard_sizes.values()), dim=-1) for layer in ranks]
    return torch.cat([torch.cat([outs[r][i] for r in range(2)], dim=-1) for i in range(len(SHARDS[kind]))], dim=-1)
