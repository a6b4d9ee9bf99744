"""GPTQ checkpoints (AutoGPTQ / GPTQModel / optimum exports): 4-bit weights, a scale and a zero point
per group, optionally in activation order (desc_act).

config.json `quantization_config`: {"quant_method": "gptq", "bits": 4, "group_size": 128 (-1: one
group per column), "desc_act": false, "sym": true, "checkpoint_format": "gptq"}.

Tensors of each linear layer (K inputs, N outputs, G = ceil(K / group_size)):

  qweight  int32 [K/8, N]  8 consecutive input rows per word, row 8w + i in nibble i
  qzeros   int32 [G, N/8]  zero points, 8 consecutive output columns per word; the "gptq" (v1)
                           format stores zero - 1 (AutoGPTQ's kernels add the 1 back, so a stored 15
                           means 16), "gptq_v2" the zero itself
  scales   fp16  [G, N]
  g_idx    int32 [K]       the group of each input row (act-order: not k // group_size); optional
                           without desc_act (exports carry it anyway, and it is used when present)

  W[n, k] = (q[k, n] - z[g_idx[k], n]) * s[g_idx[k], n]

Some exports also carry a `bias` for every layer, zeros where the model has none; those are
accepted and checked to be zero. Act-order runs with one rank only (a row-parallel split of shuffled
groups is not implemented); other bit widths, the "marlin" checkpoint format, a quantized LM head and
per-module `dynamic` overrides are refused by name.
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
    unpack_nibbles,
)
from ferrox.layers.quant.method import QuantConfig
from ferrox.model_spec import ModelSpec, UnsupportedModelError

if TYPE_CHECKING:
    from ferrox.layers.linear import Linear

_FORMATS = {"gptq": 1, "gptq_v2": 0}  # checkpoint_format -> what to add to a stored zero point


class GPTQLinearMethod(Int4LinearMethod):
    g_idx_param = "g_idx"
    layouts = {
        "qweight": TensorLayout(0, "k8", 1),
        "qzeros": TensorLayout(0, "group", 1, out_packed=True),
        "scales": TensorLayout(0, "group", 1),
        "g_idx": TensorLayout(0, "k", None),
    }

    def __init__(self, group_size: int, desc_act: bool, zero_offset: int):
        super().__init__(group_size)
        self.zero_offset = zero_offset
        self.checkpoint_params = ("qweight", "qzeros", "scales", *(("g_idx",) if desc_act else ()))
        self.optional_params = (*(() if desc_act else ("g_idx",)), "bias")

    def load(self, layer: Linear, param_name: str, tensor: Weight, shard: str | None) -> None:
        if param_name == "bias":
            _load_bias(layer, tensor, shard)
            return
        super().load(layer, param_name, tensor, shard)

    def to_shard(self, tensors: dict[str, torch.Tensor], rows: int, k: int) -> Int4Shard:
        codes = unpack_nibbles(tensors["qweight"], 0).t().contiguous()
        zeros = unpack_nibbles(tensors["qzeros"], 1) + self.zero_offset
        return Int4Shard(codes, tensors["scales"], zeros, tensors.get("g_idx"))


def _load_bias(layer: Linear, tensor: Weight, shard: str | None) -> None:
    """A layer with a bias loads it as usual; one without must get zeros (exports write them)."""
    from ferrox.layers.linear import MergedLinear

    if layer.bias is None:
        if materialize(tensor).any():
            raise ValueError("bias: the checkpoint has a non-zero bias for a layer config.json builds without one "
                             "(attention_bias / mlp_bias)")
        return
    if isinstance(layer, MergedLinear) and shard is not None:
        layer.load_shard("bias", shard, tensor)
        return
    value = materialize(tensor)
    if tuple(value.shape) != tuple(layer.bias.shape):
        raise ValueError(f"bias: checkpoint shape {tuple(value.shape)}, model expects {tuple(layer.bias.shape)}")
    layer.bias.data.copy_(value)


class GPTQConfig(QuantConfig):
    name = "gptq"

    def __init__(self, group_size: int, desc_act: bool, checkpoint_format: str):
        self.group_size = group_size
        self.desc_act = desc_act
        self.checkpoint_format = checkpoint_format

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> GPTQConfig:
        where = "config.json quantization_config"
        bits = cfg.get("bits", 4)
        if bits != 4:
            raise UnsupportedModelError(f"{where}.bits = {bits!r}: ferrox runs 4-bit GPTQ checkpoints only")
        group = cfg.get("group_size", 128)
        if not isinstance(group, int) or not (group == -1 or (group > 0 and group % 32 == 0)):
            raise UnsupportedModelError(f"{where}.group_size = {group!r}: expected -1 or a positive multiple of 32")
        fmt = str(cfg.get("checkpoint_format") or "gptq").lower()
        if fmt not in _FORMATS:
            raise UnsupportedModelError(f"{where}.checkpoint_format = {cfg.get('checkpoint_format')!r}: ferrox reads "
                                        f"{' and '.join(repr(f) for f in _FORMATS)} checkpoints")
        if cfg.get("lm_head"):
            raise UnsupportedModelError(f"{where}.lm_head = true: a quantized LM head is not supported (ferrox keeps "
                                        "the LM head in the model dtype)")
        if cfg.get("dynamic"):
            raise UnsupportedModelError(f"{where}.dynamic: per-module GPTQ overrides are not supported")
        desc_act = cfg.get("desc_act", False)
        if not isinstance(desc_act, bool):
            raise UnsupportedModelError(f"{where}.desc_act = {desc_act!r}: expected true or false")
        return cls(group, desc_act, fmt)

    def check(self, spec: ModelSpec, device: torch.device, tp_size: int) -> None:
        if self.desc_act and tp_size > 1:
            raise UnsupportedModelError("GPTQ with desc_act (act-order) runs with tensor_parallel_size=1 only: a "
                                        "row-parallel split of its shuffled groups is not implemented")
        check_int4_shapes(spec, tp_size, self.group_size, "GPTQ")

    def linear_method(self, layer: Linear) -> GPTQLinearMethod:
        return GPTQLinearMethod(self.group_size, self.desc_act, _FORMATS[self.checkpoint_format])

    def describe(self) -> str:
        group = "per column" if self.group_size == -1 else f"group {self.group_size}"
        order = ", act-order" if self.desc_act else ""
        return f"gptq: int4 weights, {group}{order} ({self.checkpoint_format} format)"
