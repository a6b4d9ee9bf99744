"""AWQ checkpoints (AutoAWQ / llm-awq "GEMM" layout): 4-bit weights with a zero point per group.

config.json `quantization_config`: {"quant_method": "awq", "bits" (or "w_bit"): 4, "group_size" (or
"q_group_size"): 128, "zero_point": true, "version": "gemm", "modules_to_not_convert": null}.

Tensors of each linear layer (K inputs, N outputs, G = K / group_size):

  qweight  int32 [K, N/8]  8 output columns per word, column c of the word in nibble
                           (0, 4, 1, 5, 2, 6, 3, 7)[c] (AWQ's packing order 0, 2, 4, 6, 1, 3, 5, 7)
  qzeros   int32 [G, N/8]  the zero points, packed the same way
  scales   fp16  [G, N]

  W[n, k] = (q[k, n] - z[k // group_size, n]) * s[k // group_size, n]

Other AWQ kernels' layouts ("gemv", "gemv_fast", "exllama", "marlin", "ipex" versions) are refused by
name; the layers run through int4_pack.py's runner and kernels/int4_matmul.py.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from ferrox.layers.quant.int4_pack import (
    AWQ_NIBBLE_OF_COLUMN,
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

# Modules AWQ exports may list as left in float that are not linear layers in ferrox (they never are
# quantized here anyway).
_NEVER_QUANTIZED = ("lm_head", "embed_tokens", "norm")


class AWQLinearMethod(Int4LinearMethod):
    checkpoint_params = ("qweight", "qzeros", "scales")
    layouts = {
        "qweight": TensorLayout(0, "k", 1, out_packed=True),
        "qzeros": TensorLayout(0, "group", 1, out_packed=True),
        "scales": TensorLayout(0, "group", 1),
    }

    def to_shard(self, tensors: dict[str, torch.Tensor], rows: int, k: int) -> Int4Shard:
        codes = unpack_nibbles(tensors["qweight"], 1, AWQ_NIBBLE_OF_COLUMN).t().contiguous()
        zeros = unpack_nibbles(tensors["qzeros"], 1, AWQ_NIBBLE_OF_COLUMN)
        return Int4Shard(codes, tensors["scales"], zeros)


class AWQConfig(QuantConfig):
    name = "awq"

    def __init__(self, group_size: int):
        self.group_size = group_size

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> AWQConfig:
        where = "config.json quantization_config"
        bits = cfg.get("bits", cfg.get("w_bit", 4))
        if bits != 4:
            raise UnsupportedModelError(f"{where}.bits = {bits!r}: ferrox runs 4-bit AWQ checkpoints only")
        group = cfg.get("group_size", cfg.get("q_group_size", 128))
        if not isinstance(group, int) or not (group == -1 or (group > 0 and group % 32 == 0)):
            raise UnsupportedModelError(f"{where}.group_size = {group!r}: expected -1 or a positive multiple of 32")
        if cfg.get("zero_point", True) is not True:
            raise UnsupportedModelError(f"{where}.zero_point = {cfg.get('zero_point')!r}: ferrox runs AWQ with zero "
                                        "points (zero_point: true) only")
        version = str(cfg.get("version", "gemm")).lower()
        if version != "gemm":
            raise UnsupportedModelError(f"{where}.version = {cfg.get('version')!r}: ferrox reads the AWQ 'gemm' "
                                        "layout only (re-export the checkpoint with version 'gemm')")
        for module in cfg.get("modules_to_not_convert") or []:
            if str(module).rsplit(".", 1)[-1] not in _NEVER_QUANTIZED:
                raise UnsupportedModelError(
                    f"{where}.modules_to_not_convert lists {module!r}: ferrox quantizes every linear layer of the "
                    f"decoder (only {', '.join(_NEVER_QUANTIZED)}, which are never quantized, may be listed)")
        return cls(group)

    def check(self, spec: ModelSpec, device: torch.device, tp_size: int) -> None:
        check_int4_shapes(spec, tp_size, self.group_size, "AWQ")

    def linear_method(self, layer: Linear) -> AWQLinearMethod:
        return AWQLinearMethod(self.group_size)

    def describe(self) -> str:
        group = "per column" if self.group_size == -1 else f"group {self.group_size}"
        return f"awq: int4 weights, {group}, zero points (GEMM layout)"
