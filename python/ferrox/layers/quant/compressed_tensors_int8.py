"""llm-compressor's compressed-tensors int8 checkpoints ("W8A8" int, `format: int-quantized`, and the
weight-only W8A16 int8 scheme): read into the int8 runner of int8_linear.py.

config.json quantization_config, the parts that decide how the model runs:

    {"quant_method": "compressed-tensors", "format": "int-quantized" | "naive-quantized",
     "config_groups": {"group_0": {"targets": ["Linear"],
         "weights": {"num_bits": 8, "type": "int", "symmetric": true, "strategy": "channel" | "tensor",
                     "dynamic": false},
         "input_activations": {"num_bits": 8, "type": "int", "symmetric": true,
                               "strategy": "token" (dynamic) | "tensor" (static or dynamic)}
                            | null}},                          (null: weight-only, W8A16)
     "ignore": ["lm_head"]}

Tensors of each linear layer: `weight` int8 [out, in]; `weight_scale` [out, 1] (channel) or [1]
(tensor), in the model dtype or float32; `input_scale` [1] with static activations. Some symmetric
exports also store all-zero `weight_zero_point` / `input_zero_point`: checked to be zero, then
dropped. W = weight * weight_scale; activations rounded as vLLM rounds them (int8_linear.py).

The weight-only W8A16 int8 scheme is also published packed (`format: pack-quantized`, num_bits 8,
input_activations null): `weight_packed` int32 [out, ceil(in / 4)], four consecutive inputs per word,
input 4w + i in byte i, each stored as the signed value plus 128; `weight_shape` [2] = (out, in),
checked. It is unpacked to the int8 `weight` above at load, so it runs the same weight-only kernels.

Loading and tensor-parallel sharding are fp8.py's checkpoint method (subclassed, int8 codes): a merged
layer (q/k/v, gate/up) writes each shard's scale into that shard's rows, so per-tensor scales become
per-row ones without requantizing, and its static input scale is the largest of its shards' (as
vLLM takes it). Asymmetric weights or activations, group or block scales, other bit widths,
actorder, dynamic weight scales and unknown fields are refused by the field that asks for them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from ferrox.distributed.sharding import Weight, materialize
from ferrox.layers.quant.compressed_tensors import ARG_FIELDS, CompressedTensorsFp8Method
from ferrox.layers.quant.fp8 import _rank_weight
from ferrox.layers.quant.fp8_linear import ACTIVATIONS
from ferrox.layers.quant.int4_pack import checkpoint_extent
from ferrox.layers.quant.int8_linear import Int8Linear, quantize_int8_per_row
from ferrox.layers.quant.method import QuantConfig
from ferrox.model_spec import UnsupportedModelError

if TYPE_CHECKING:
    from ferrox.layers.linear import Linear
    from ferrox.layers.quant.excluded_modules import ExcludeList
    from ferrox.model_spec import ModelSpec

FORMATS = ("int-quantized", "naive-quantized")
PACKED_FORMAT = "pack-quantized"  # weight-only 8-bit ints, four to an int32 (module docstring)
_PACK = 4  # int8 values per stored int32 word
_STORED_OFFSET = 128  # what the packed format adds to every signed 8-bit value
# load_format="dummy" with static activations: a dummy model's activations (|x| up to ~10) fit
# under this scale (127 steps of 1/12) without saturating.
_DUMMY_INPUT_SCALE = 1.0 / 12
_ACTIVATION_NAMES = {"dynamic-token": "W8A8, activations int8 per token (dynamic)",
                     "dynamic-tensor": "W8A8, activations int8 per tensor (dynamic)",
                     "static": "W8A8, activations int8 with the checkpoint's static scales",
                     "weight-only": "W8A16, activations unquantized"}


# ---- the per-layer method -------------------------------------------------------------------------
class CompressedTensorsInt8Method(CompressedTensorsFp8Method):
    """One layer's int8 checkpoint tensors (module docstring), gathered into `Int8Linear`: the fp8
    checkpoint method's loading (input scales, per-row scales, shards, all-zero zero points) with
    int8 codes, the packed layout's unpacking, and the int8 runner."""

    weight_dtype = torch.int8
    layout = "int-quantized"
    dummy_input_scale = _DUMMY_INPUT_SCALE
    runner_class = Int8Linear  # (its weight and scales go to the layer as fp8's, for the fused kernels)

    def __init__(self, activations: str, packed: bool = False):
        if activations not in ACTIVATIONS:
            raise ValueError(f"activations must be one of {', '.join(ACTIVATIONS)}, got {activations!r}")
        if packed and activations != "weight-only":
            raise ValueError("packed int8 weights are weight-only")
        super().__init__(activations, ("weight_packed",) if packed else ("weight",))
        if packed:
            self.checkpoint_params = (*self.checkpoint_params, "weight_shape")

    def load(self, layer: Linear, param_name: str, tensor: Weight, shard: str | None) -> None:
        if param_name == "weight_shape":
            rows, k = checkpoint_extent(layer, shard)
            value = materialize(tensor)
            if value.numel() != 2 or value.flatten().tolist() != [rows, k]:
                raise ValueError(f"weight_shape: {value.flatten().tolist()}, the model's layer is [{rows}, {k}]")
            return
        super().load(layer, param_name, tensor, shard)

    def _rank_part(self, layer: Linear, param_name: str, tensor: Weight, first: int, held: int,
                   full: int) -> torch.Tensor:
        if param_name == "weight_packed":
            return _unpack_int8(_rank_weight(layer, tensor, first, held, full, _PACK), layer.in_features)
        return super()._rank_part(layer, param_name, tensor, first, held, full)

    @staticmethod
    def _quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return quantize_int8_per_row(weight)


# ---- the model's config ---------------------------------------------------------------------------
class CompressedTensorsInt8Config(QuantConfig):
    name = "compressed-tensors"

    def __init__(self, activations: str, weight_strategy: str = "channel",
                 excluded: ExcludeList | None = None, packed: bool = False):
        if activations not in ACTIVATIONS:
            raise ValueError(f"activations must be one of {', '.join(ACTIVATIONS)}, got {activations!r}")
        self.activations = activations
        self.weight_strategy = weight_strategy
        self.excluded = excluded
        self.packed = packed

    @classmethod
    def from_scheme(cls, fmt: Any, scheme: dict[str, Any], where: str,
                    excluded: ExcludeList) -> CompressedTensorsInt8Config:
        """One scheme group (`where` names it; its targets checked) whose weights are ints in an
        unpacked format; fmt: the top-level format."""
        packed = fmt == PACKED_FORMAT
        if (fmt not in FORMATS and not packed) or scheme.get("format") not in (None, fmt):
            raise UnsupportedModelError(f"config.json quantization_config.format {fmt!r} ({where}.format "
                                        f"{scheme.get('format')!r}): int8 weights are read in the "
                                        f"{' / '.join(map(repr, (*FORMATS, PACKED_FORMAT)))} formats")
        if packed and scheme.get("input_activations") is not None:
            raise UnsupportedModelError(f"{where}.input_activations: 8-bit ints in the {PACKED_FORMAT!r} format are "
                                        "read as weight-only (W8A16) schemes; int8 activations come in 'int-quantized'")
        weights = scheme["weights"]
        _int8_args(weights, f"{where}.weights")
        strategy = weights.get("strategy")
        if strategy not in ("channel", "tensor"):
            raise UnsupportedModelError(f"{where}.weights.strategy {strategy!r}: int8 weights need 'channel' or "
                                        "'tensor' scales")
        if weights.get("dynamic", False) is not False:
            raise UnsupportedModelError(f"{where}.weights.dynamic {weights['dynamic']!r}: int8 weights need static "
                                        "scales (stored in the checkpoint)")
        return cls(_activations(scheme.get("input_activations"), f"{where}.input_activations"), strategy,
                   excluded, packed)

    def check(self, spec: ModelSpec, device: torch.device, tp_size: int) -> None:
        if (device.type == "cuda" and self.activations != "weight-only"
                and torch.cuda.get_device_capability(device) < (8, 0)):
            major, minor = torch.cuda.get_device_capability(device)
            raise UnsupportedModelError(f"compressed-tensors int8 W8A8: the int8 tensor-core matmuls need a GPU of "
                                        f"compute capability 8.0 or newer; this one is {major}.{minor}")

    def linear_method(self, layer: Linear) -> CompressedTensorsInt8Method:
        return CompressedTensorsInt8Method(self.activations, self.packed)

    def describe(self) -> str:
        scales = "per-channel" if self.weight_strategy == "channel" else "per-tensor"
        packed = " (packed)" if self.packed else ""
        return f"compressed-tensors: int8 weights{packed}, {scales} scales, {_ACTIVATION_NAMES[self.activations]}"


def _unpack_int8(words: torch.Tensor, in_features: int) -> torch.Tensor:
    """int32 words [rows, W] -> int8 [rows, in_features]: input 4w + i from byte i of word w, minus
    the stored offset of 128 (the words' padding past in_features dropped)."""
    if words.dtype != torch.int32 or words.dim() != 2:
        raise ValueError(f"weight_packed must be int32 [out, in / {_PACK}], got {words.dtype} {tuple(words.shape)}")
    if words.shape[1] != -(-in_features // _PACK):
        raise ValueError(f"weight_packed has {words.shape[1]} words a row; {in_features} inputs need "
                         f"{-(-in_features // _PACK)}")
    shifts = torch.arange(0, 32, 8, dtype=torch.int32, device=words.device)
    stored = (words.unsqueeze(-1) >> shifts) & 0xFF  # [rows, W, 4], each 0..255
    return (stored.flatten(1)[:, :in_features] - _STORED_OFFSET).to(torch.int8)


def _int8_args(args: Any, where: str) -> None:
    """Refuse, by field, a weights / input_activations entry that is not symmetric 8-bit int with one
    scale per channel, token or tensor."""
    if not isinstance(args, dict):
        raise UnsupportedModelError(f"{where}: expected a quantization scheme object, got {args!r}")
    unknown = sorted(k for k in args if k not in ARG_FIELDS)
    if unknown:
        raise UnsupportedModelError(f"{where}: field(s) {', '.join(unknown)} are not supported")
    if args.get("type") != "int":
        raise UnsupportedModelError(f"{where}.type {args.get('type')!r}: an int8 scheme quantizes weights and "
                                    "activations to int (float activations with int weights are not supported)")
    if args.get("num_bits") != 8:
        raise UnsupportedModelError(f"{where}.num_bits {args.get('num_bits')!r}: the int-quantized layout holds "
                                    "8-bit ints (4-bit int weights are read in the 'pack-quantized' format, "
                                    "config.json quantization_config.format)")
    if args.get("symmetric", True) is not True:
        raise UnsupportedModelError(f"{where}.symmetric {args.get('symmetric')!r}: asymmetric int8 (zero points) is "
                                    "not supported")
    for key in ("group_size", "block_structure"):
        if args.get(key) is not None:
            raise UnsupportedModelError(f"{where}.{key} {args[key]!r}: group/block scales are not supported for "
                                        "int8 (per-channel, per-token or per-tensor only)")
    if args.get("actorder") not in (None, False):
        raise UnsupportedModelError(f"{where}.actorder {args['actorder']!r}: act-order is not supported for int8")


def _activations(inputs: Any, where: str) -> str:
    """The activations mode (fp8_linear.ACTIVATIONS) of an input_activations entry."""
    if inputs is None:
        return "weight-only"
    _int8_args(inputs, where)
    strategy, dynamic = inputs.get("strategy"), inputs.get("dynamic", False)
    if dynamic not in (True, False):
        raise UnsupportedModelError(f"{where}.dynamic {dynamic!r}: expected true or false")
    if strategy == "token" and dynamic:
        return "dynamic-token"
    if strategy == "tensor":
        return "dynamic-tensor" if dynamic else "static"
    raise UnsupportedModelError(f"{where}.strategy {strategy!r} with dynamic={dynamic!r} is not supported ('token' "
                                "dynamic, or 'tensor' static or dynamic)")
