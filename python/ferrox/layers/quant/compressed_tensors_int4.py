"""llm-compressor's compressed-tensors int4 weight-only checkpoints ("W4A16", `format: pack-quantized`,
GPTQ or round-to-nearest inside): read into the int4 layout of int4_pack.py and run by the same
runner and kernels as AWQ and GPTQ.

config.json quantization_config, the parts that decide how the model runs:

    {"quant_method": "compressed-tensors", "format": "pack-quantized",
     "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": null,
         "weights": {"num_bits": 4, "type": "int", "symmetric": true | false,
                     "strategy": "group" | "channel", "group_size": 128, "dynamic": false,
                     "actorder": null | "weight" | "group"}}},
     "ignore": ["lm_head"]}

Tensors of each linear layer (K inputs, N outputs, G = ceil(K / group_size), one group for "channel"):

  weight_packed      int32 [N, K/8]  8 consecutive inputs per word, input 8w + i in nibble i, each
                                     stored as the signed code plus 8 (so 0..15)
  weight_scale       [N, G]          in the model dtype
  weight_zero_point  int32 [N/8, G]  asymmetric only: the zero points plus 8, 8 consecutive outputs per
                                     word (packed along N)
  weight_g_idx       int32 [K]       actorder "group" only: the group of each input column
  weight_shape       int [2]         (N, K), checked

  W[n, k] = (stored_q[n, k] - stored_z[n, g]) * s[n, g],  g = g_idx[k] (else k // group_size),
  stored_z = 8 when symmetric. Both stored values carry the same +8, so they are the unsigned
  codes and zero points the int4 runner takes as they are.

actorder "weight" reorders columns only while quantizing (nothing is stored for it); "group" stores
g_idx and runs as GPTQ's act-order does (one gather of x per call; one rank only). 8-bit packed ints
are read by compressed_tensors_int8.py. Every other scheme (2/3-bit ints, "tensor" or block strategies, dynamic weight scales, int activations
(W4A8), per-layer scheme groups) is refused by the field that asks for it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from ferrox.distributed.sharding import Weight, materialize
from ferrox.layers.quant.int4_pack import (
    Int4LinearMethod,
    Int4Shard,
    TensorLayout,
    check_int4_shapes,
    checkpoint_extent,
    unpack_nibbles,
)
from ferrox.layers.quant.method import QuantConfig
from ferrox.model_spec import ModelSpec, UnsupportedModelError

if TYPE_CHECKING:
    from ferrox.layers.linear import Linear
    from ferrox.layers.quant.excluded_modules import ExcludeList

FORMAT = "pack-quantized"
# actorder values: without a stored index (the order only guided quantization), and with one.
_STATIC_ORDERS = (None, False, "weight", "static")
_GROUP_ORDERS = ("group", "dynamic")
_STORED_OFFSET = 8  # what the format adds to every signed 4-bit value it packs


class CompressedTensorsInt4Method(Int4LinearMethod):
    g_idx_param = "weight_g_idx"
    layouts = {
        "weight_packed": TensorLayout(1, "k8", 0),
        "weight_scale": TensorLayout(1, "group", 0),
        "weight_zero_point": TensorLayout(1, "group", 0, out_packed=True),
        "weight_g_idx": TensorLayout(0, "k", None),
    }

    def __init__(self, group_size: int, symmetric: bool, group_order: bool):
        super().__init__(group_size)
        self.symmetric = symmetric
        self.checkpoint_params = ("weight_packed", "weight_scale", "weight_shape",
                                  *(() if symmetric else ("weight_zero_point",)),
                                  *(("weight_g_idx",) if group_order else ()))
        # Some symmetric exports carry all-zero zero points (checked); static-order ones may carry g_idx.
        self.optional_params = (*(("weight_zero_point",) if symmetric else ()),
                                *(() if group_order else ("weight_g_idx",)))

    def load(self, layer: Linear, param_name: str, tensor: Weight, shard: str | None) -> None:
        if param_name == "weight_shape":
            self._check_shape(layer, materialize(tensor), shard)
            # Nothing to keep, but an entry, so that finalize counts the (required) tensor as arrived.
            self._tensors.setdefault(shard or "weight", {})[param_name] = torch.empty(0)
            return
        if param_name == "weight_zero_point" and self.symmetric:
            if materialize(tensor).to(torch.int64).any():
                raise ValueError("weight_zero_point is not zero: an asymmetric scheme, which the config's "
                                 "weights.symmetric = true says it is not")
            return
        super().load(layer, param_name, tensor, shard)

    def _check_shape(self, layer: Linear, value: torch.Tensor, shard: str | None) -> None:
        rows, k = checkpoint_extent(layer, shard)
        if value.numel() != 2 or value.flatten().tolist() != [rows, k]:
            raise ValueError(f"weight_shape: {value.flatten().tolist()}, the model's layer is [{rows}, {k}]")

    def to_shard(self, tensors: dict[str, torch.Tensor], rows: int, k: int) -> Int4Shard:
        codes = unpack_nibbles(tensors["weight_packed"], 1)
        scales = tensors["weight_scale"].t()
        if self.symmetric:
            zeros = torch.full_like(scales, _STORED_OFFSET, dtype=torch.uint8)
        else:
            zeros = unpack_nibbles(tensors["weight_zero_point"], 0).t()
        return Int4Shard(codes, scales, zeros, tensors.get("weight_g_idx"))


class CompressedTensorsInt4Config(QuantConfig):
    name = "compressed-tensors"

    def __init__(self, group_size: int, symmetric: bool, group_order: bool,
                 excluded: ExcludeList | None = None):
        self.group_size = group_size
        self.symmetric = symmetric
        self.group_order = group_order
        self.excluded = excluded

    @classmethod
    def from_scheme(cls, fmt: Any, scheme: dict[str, Any], where: str,
                    excluded: ExcludeList) -> CompressedTensorsInt4Config:
        """One scheme group (`where` names it) whose weights are ints; fmt: the top-level format."""
        from ferrox.layers.quant.compressed_tensors import ARG_FIELDS  # (that module dispatches here)

        if fmt != FORMAT or scheme.get("format") not in (None, FORMAT):
            raise UnsupportedModelError(f"config.json quantization_config.format {fmt!r} ({where}.format "
                                        f"{scheme.get('format')!r}): int weights are read in the {FORMAT!r} format only")
        inputs = scheme.get("input_activations")
        if inputs is not None:
            raise UnsupportedModelError(f"{where}.input_activations: int weights with quantized activations (W4A8, "
                                        "W8A8 int) are not supported; ferrox runs int4 weight-only (W4A16) schemes")
        weights = scheme["weights"]
        unknown = sorted(k for k in weights if k not in ARG_FIELDS)
        if unknown:
            raise UnsupportedModelError(f"{where}.weights: field(s) {', '.join(unknown)} are not supported")
        if weights.get("num_bits") != 4:
            raise UnsupportedModelError(f"{where}.weights.num_bits {weights.get('num_bits')!r}: ferrox runs 4-bit and "
                                        "8-bit int weights (2/3-bit schemes are not supported)")
        strategy = weights.get("strategy")
        if strategy == "group":
            group = weights.get("group_size")
            if not isinstance(group, int) or group <= 0 or group % 32:
                raise UnsupportedModelError(f"{where}.weights.group_size {group!r}: expected a positive multiple of 32")
        elif strategy == "channel":
            group = -1
        else:
            raise UnsupportedModelError(f"{where}.weights.strategy {strategy!r}: int4 weights need 'group' or "
                                        "'channel' scales")
        if weights.get("dynamic"):
            raise UnsupportedModelError(f"{where}.weights.dynamic: dynamic weight scales are not supported")
        if weights.get("block_structure") is not None:
            raise UnsupportedModelError(f"{where}.weights.block_structure: block scales are not supported")
        symmetric = weights.get("symmetric", True)
        if not isinstance(symmetric, bool):
            raise UnsupportedModelError(f"{where}.weights.symmetric {symmetric!r}: expected true or false")
        order = weights.get("actorder")
        if order not in (*_STATIC_ORDERS, *_GROUP_ORDERS):
            raise UnsupportedModelError(f"{where}.weights.actorder {order!r}: expected null, 'weight' or 'group'")
        return cls(group, symmetric, order in _GROUP_ORDERS, excluded)

    def check(self, spec: ModelSpec, device: torch.device, tp_size: int) -> None:
        if self.group_order and tp_size > 1:
            raise UnsupportedModelError("compressed-tensors int4 with actorder 'group' runs with "
                                        "tensor_parallel_size=1 only: a row-parallel split of its shuffled groups is "
                                        "not implemented")
        check_int4_shapes(spec, tp_size, self.group_size, "compressed-tensors int4")

    def linear_method(self, layer: Linear) -> CompressedTensorsInt4Method:
        return CompressedTensorsInt4Method(self.group_size, self.symmetric, self.group_order)

    def describe(self) -> str:
        group = "per channel" if self.group_size == -1 else f"group {self.group_size}"
        kind = "symmetric" if self.symmetric else "zero points"
        order = ", act-order (g_idx)" if self.group_order else ""
        return f"compressed-tensors: int4 weights (W4A16), {group}, {kind}{order}"
