"""llm-compressor's compressed-tensors checkpoints, float8 W8A8 / W8A16 schemes: read into the FP8
method of fp8.py (same tensors: `weight` float8_e4m3fn, `weight_scale`, `input_scale`).

config.json quantization_config, the parts that decide how the model runs:

    {"quant_method": "compressed-tensors", "format": "float-quantized" | "naive-quantized",
     "config_groups": {"group_0": {"targets": ["Linear"],
         "weights": {"num_bits": 8, "type": "float", "strategy": "channel" | "tensor", "symmetric": true},
         "input_activations": {"num_bits": 8, "type": "float", "strategy": "token" | "tensor",
                               "dynamic": true | false} | null}},        (null: weight-only FP8)
     "ignore": ["lm_head", "re:..."], "kv_cache_scheme": null, "sparsity_config": {}}

Int schemes go elsewhere (`CompressedTensorsScheme` picks by the format and bits): int8 W8A8 / W8A16
("int-quantized", "naive-quantized", and 8-bit "pack-quantized") to compressed_tensors_int8.py, int4
weight-only ("pack-quantized") to compressed_tensors_int4.py. Every other scheme (FP8 block or group
scales, asymmetric FP8, 2:4 sparsity, transforms, per-layer scheme groups, stored KV-cache scales) is
refused by the field that asks for it. Per-channel weight scales come as [out, 1], per-tensor as [1], in the
model dtype; they are widened to float32 rows. The layers `ignore` names (exact module names, `re:` regexes,
as vLLM matches them) keep the model dtype (excluded_modules.py), for every scheme; named experts are refused.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ferrox.distributed.sharding import Weight, materialize
from ferrox.layers.quant.excluded_modules import ExcludeList
from ferrox.layers.quant.fp8 import Fp8CheckpointMethod, Fp8Config, refuse_kv_cache_scheme, string_list
from ferrox.layers.quant.method import LinearWeightMethod, QuantConfig
from ferrox.model_spec import UnsupportedModelError

if TYPE_CHECKING:
    from ferrox.layers.linear import Linear

_WHERE = "config.json quantization_config"
_FORMATS = ("float-quantized", "naive-quantized")
# Top-level fields that only describe the export (ignored) and those handled below.
_METADATA = ("quantization_status", "global_compression_ratio", "version", "provider")
_FIELDS = ("quant_method", "format", "config_groups", "ignore", "kv_cache_scheme", "sparsity_config",
           "transform_config", *_METADATA)
# Fields of a weights / input_activations entry: calibration-time settings that do not change the
# stored layout, and the ones checked below.
# Module classes a recipe names beside "Linear" for experts it quantizes as linear layers; ferrox's MoE layers take
# the scheme anyway (llm-compressor's Granite 4 recipe: the fused experts as one linear layer each, saved [E, rows, in]).
_EXPERT_TARGETS = {"GraniteMoeHybridParallelExpertsLinear"}
_ARG_CALIBRATION = ("observer", "observer_kwargs", "scale_dtype", "zp_dtype")
ARG_FIELDS = ("num_bits", "type", "symmetric", "strategy", "dynamic", "group_size", "block_structure", "actorder",
               *_ARG_CALIBRATION)


class CompressedTensorsFp8Method(Fp8CheckpointMethod):
    """The fp8 checkpoint method, also taking the all-zero zero points some symmetric exports store."""

    def __init__(self, activations: str, weight_params: tuple[str, ...] = ("weight",)):
        super().__init__(activations, weight_params)
        self.optional_params = (*self.optional_params, "weight_zero_point", "input_zero_point")

    def load(self, layer: Linear, param_name: str, tensor: Weight, shard: str | None) -> None:
        if param_name.endswith("_zero_point"):
            if materialize(tensor).float().abs().max() != 0:
                raise ValueError(f"{param_name} is not zero: an asymmetric scheme, which the config says it is not")
            return
        super().load(layer, param_name, tensor, shard)


class CompressedTensorsConfig(Fp8Config):
    name = "compressed-tensors"

    @classmethod
    def from_hf(cls, cfg: dict) -> QuantConfig:
        """A float8 scheme's config (CompressedTensorsScheme.from_hf routes int schemes elsewhere); the
        block scheme (llm-compressor's FP8_BLOCK) goes to fp8_block.py's config."""
        where, group, excluded = _one_scheme(cfg)
        _check_format(cfg.get("format"), f"{_WHERE}.format")
        weights = group.get("weights") if isinstance(group, dict) else None
        if isinstance(weights, dict) and weights.get("strategy") == "block":
            return _block_scheme(group, where, excluded)
        activations = _group_activations(group, where)
        return cls(online=False, activations=activations, excluded=excluded)

    def linear_method(self, layer: Linear) -> LinearWeightMethod:
        return CompressedTensorsFp8Method(self.activations)


class CompressedTensorsScheme:
    """What the resolver (layers/quant/config.py) calls for quant_method "compressed-tensors": the
    QuantConfig of the checkpoint's one scheme, float8 (CompressedTensorsConfig above), int8 in an
    unpacked format (compressed_tensors_int8.py) or int4 weight-only, packed
    (compressed_tensors_int4.py, which refuses every other int format by name)."""

    @staticmethod
    def from_hf(cfg: dict) -> QuantConfig:
        where, group, excluded = _one_scheme(cfg)
        weights = group.get("weights") if isinstance(group, dict) else None
        if isinstance(weights, dict) and weights.get("type") == "int":
            from ferrox.layers.quant import compressed_tensors_int8 as int8
            from ferrox.layers.quant.compressed_tensors_int4 import CompressedTensorsInt4Config

            _check_targets(group, where)
            fmt = cfg.get("format")
            if fmt in int8.FORMATS or (fmt == int8.PACKED_FORMAT and weights.get("num_bits") == 8):
                return int8.CompressedTensorsInt8Config.from_scheme(fmt, group, where, excluded)
            return CompressedTensorsInt4Config.from_scheme(fmt, group, where, excluded)
        return CompressedTensorsConfig.from_hf(cfg)


def _one_scheme(cfg: dict) -> tuple[str, Any, ExcludeList]:
    """The checks every scheme shares; (where, the one scheme group, the ignore list: exact module names and
    `re:` regexes, the layers it names kept in the model dtype, excluded_modules.py)."""
    unknown = sorted(k for k in cfg if k not in _FIELDS and not k.startswith("_"))
    if unknown:
        raise UnsupportedModelError(f"{_WHERE}: field(s) {', '.join(unknown)} of compressed-tensors are not "
                                    "supported (report the checkpoint)")
    refuse_kv_cache_scheme(cfg.get("kv_cache_scheme"), f"{_WHERE}.kv_cache_scheme")
    sparsity = cfg.get("sparsity_config")
    if sparsity and not (isinstance(sparsity, dict) and sparsity.get("format") == "dense"):
        raise UnsupportedModelError(f"{_WHERE}.sparsity_config: sparse compressed-tensors checkpoints (2:4, "
                                    "bitmask) are not supported")
    if cfg.get("transform_config"):
        raise UnsupportedModelError(f"{_WHERE}.transform_config: rotated/transformed weights are not supported")
    groups = cfg.get("config_groups")
    if not isinstance(groups, dict) or len(groups) != 1:
        count = len(groups) if isinstance(groups, dict) else 0
        raise UnsupportedModelError(f"{_WHERE}.config_groups: {count} scheme groups; ferrox runs one scheme over "
                                    "every Linear layer (per-layer schemes are not supported)")
    (name, group), = groups.items()
    excluded = ExcludeList(string_list(cfg.get("ignore"), f"{_WHERE}.ignore"), f"{_WHERE}.ignore",
                           syntax="compressed-tensors")
    return f"{_WHERE}.config_groups.{name}", group, excluded


def _check_format(fmt: Any, where: str) -> None:
    if fmt not in _FORMATS:
        raise UnsupportedModelError(f"{where} {fmt!r}: only float8 compressed-tensors checkpoints "
                                    f"({' / '.join(_FORMATS)}) are supported")


def _check_targets(group: Any, where: str) -> None:
    if not isinstance(group, dict):
        raise UnsupportedModelError(f"{where}: expected a scheme object, got {group!r}")
    targets = group.get("targets")
    if not isinstance(targets, list) or targets[:1] != ["Linear"] or not set(targets[1:]) <= _EXPERT_TARGETS:
        raise UnsupportedModelError(f"{where}.targets {targets!r}: only ['Linear'] (every linear layer, and the "
                                    f"experts as linear layers: {', '.join(sorted(_EXPERT_TARGETS))}) is supported")
    if group.get("output_activations") is not None:
        raise UnsupportedModelError(f"{where}.output_activations: output quantization is not supported")


def _group_activations(group: Any, where: str) -> str:
    """The activations mode (fp8.ACTIVATIONS) of one scheme group, refusing what is not float8."""
    _check_targets(group, where)
    if "format" in group and group["format"] is not None:
        _check_format(group["format"], f"{where}.format")
    weights = group.get("weights")
    if not isinstance(weights, dict):
        raise UnsupportedModelError(f"{where}.weights: expected a float8 weight scheme, got {weights!r}")
    strategy, dynamic = _float8_args(weights, f"{where}.weights")
    if strategy not in ("channel", "tensor") or dynamic:
        raise UnsupportedModelError(f"{where}.weights: strategy {strategy!r}{' (dynamic)' if dynamic else ''}; "
                                    "float8 weights need static 'channel' or 'tensor' scales")
    inputs = group.get("input_activations")
    if inputs is None:
        return "weight-only"
    strategy, dynamic = _float8_args(inputs, f"{where}.input_activations")
    if strategy == "token" and dynamic:
        return "dynamic-token"
    if strategy == "tensor":
        return "dynamic-tensor" if dynamic else "static"
    raise UnsupportedModelError(f"{where}.input_activations: strategy {strategy!r} with dynamic={dynamic!r} is not "
                                "supported ('token' dynamic, or 'tensor' static or dynamic)")


def _block_scheme(group: Any, where: str, excluded: ExcludeList) -> QuantConfig:
    """float8 weights in blocks (`block_structure` [BN, BK], scales stored as `weight_scale`) with
    activations quantized per token and group of BK at run time: the block-wise FP8 of the fp8
    layout (fp8_block.py), under compressed-tensors' names."""
    from ferrox.layers.quant.fp8_block import Fp8BlockConfig  # (it builds on fp8.py, as this module)

    _check_targets(group, where)
    if group.get("format") is not None:
        _check_format(group["format"], f"{where}.format")
    weights = group["weights"]
    _, dynamic = _float8_args(weights, f"{where}.weights", scales="block_structure")
    if dynamic:
        raise UnsupportedModelError(f"{where}.weights.dynamic {weights['dynamic']!r}: block scales are stored")
    block = Fp8BlockConfig.block_size(weights.get("block_structure"), f"{where}.weights.block_structure")
    inputs = group.get("input_activations")
    if not isinstance(inputs, dict):
        raise UnsupportedModelError(f"{where}.input_activations {inputs!r}: block-wise float8 weights run with "
                                    "activations quantized per token group (weight-only blocks are not supported)")
    strategy, dynamic = _float8_args(inputs, f"{where}.input_activations", scales="group_size")
    if strategy != "group" or not dynamic or inputs.get("group_size") != block[1]:
        raise UnsupportedModelError(f"{where}.input_activations: strategy {strategy!r}, dynamic {dynamic!r}, "
                                    f"group_size {inputs.get('group_size')!r}; block-wise weights need 'group' "
                                    f"activations, dynamic, in groups of the block's {block[1]} inputs")
    return Fp8BlockConfig(block, excluded, name="compressed-tensors", scale_param="weight_scale")


def _float8_args(args: dict, where: str, scales: str | None = None) -> tuple[Any, bool]:
    """(strategy, dynamic) of a symmetric 8-bit float entry; anything else refused by field. scales:
    the one of group_size / block_structure the caller reads (the others must be unset)."""
    unknown = sorted(k for k in args if k not in ARG_FIELDS)
    if unknown:
        raise UnsupportedModelError(f"{where}: field(s) {', '.join(unknown)} are not supported")
    if args.get("num_bits") != 8 or args.get("type") != "float":
        raise UnsupportedModelError(f"{where}: {args.get('num_bits')}-bit {args.get('type')} quantization is not "
                                    "supported (only 8-bit float, FP8 E4M3, compressed-tensors checkpoints)")
    if args.get("symmetric", True) is not True:
        raise UnsupportedModelError(f"{where}.symmetric: asymmetric FP8 (zero points) is not supported")
    for key in ("group_size", "block_structure"):
        if key != scales and args.get(key) is not None:
            raise UnsupportedModelError(f"{where}.{key} {args[key]!r}: group/block scales are not supported "
                                        "(per-channel or per-tensor only)")
    if args.get("actorder") not in (None, False):
        raise UnsupportedModelError(f"{where}.actorder {args['actorder']!r} is not supported")
    return args.get("strategy"), bool(args.get("dynamic", False))
