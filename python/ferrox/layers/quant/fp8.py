"""FP8 weights: float8 E4M3 with one float32 scale per output row, quantized at load from a float
checkpoint (`quantization="fp8"`) or read from a checkpoint published in FP8.

The "fp8" checkpoint layout (AutoFP8, transformers; config.json quantization_config
{"quant_method": "fp8", "activation_scheme": "dynamic" | "static"}): per linear layer `weight`
float8_e4m3fn [out, in], `weight_scale` per tensor (one value) or per output row, and with static
activations `input_scale` (one value). llm-compressor's float8 layout (compressed_tensors.py) loads
into the same method. Block-wise checkpoints (`weight_block_size`, `weight_scale_inv`) load through
fp8_block.py.
A merged layer (q/k/v, gate/up) writes each shard's scale into that shard's rows, so per-tensor
scales become per-row ones without requantizing; its static input scale is the largest of its
shards' (the scale that fits every shard's calibrated activations).
The modules a checkpoint leaves in float (`ignored_layers` / `modules_to_not_convert`, by substring, as vLLM
reads them) keep the model dtype (excluded_modules.py); named experts are refused.

The runner (`Fp8Linear`: how a layer multiplies) and the activation quantizer are in fp8_linear.py.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from ferrox.distributed.sharding import Weight, materialize, narrow, shape_of
from ferrox.layers.linear import Linear, RowParallelLinear
from ferrox.layers.quant.excluded_modules import ExcludeList
from ferrox.layers.quant.fp8_linear import (
    ACTIVATIONS,
    FP8_DTYPE,
    Fp8Linear,
    RowScaledLinear,
    quantize_per_row,
)
from ferrox.layers.quant.method import LinearWeightMethod, QuantConfig
from ferrox.model_spec import UnsupportedModelError

if TYPE_CHECKING:
    from ferrox.layers.fused_moe import FusedMoE
    from ferrox.layers.quant.fp8_moe import Fp8MoeMethod
    from ferrox.model_spec import ModelSpec

# load_format="dummy" for a static checkpoint: a dummy model's activations (|x| up to ~10) fit
# under this scale (448 / 32 = 14) without saturating.
_DUMMY_INPUT_SCALE = 1.0 / 32


# ---- per-layer methods --------------------------------------------------------------------------
class _Fp8Method(LinearWeightMethod):
    # The fused one-token kernels read `layer.weight` (fp8, or int8 for the int8 subclass) and
    # `layer.weight_scale` (float32 rows), and ask the runner `one_token_w8a8()`.
    fused_decode = True
    runner_class: type[RowScaledLinear] = Fp8Linear

    def __init__(self, activations: str):
        self.activations = activations

    def _runner(self, layer: Linear, weight: torch.Tensor, scale: torch.Tensor,
                input_scale: torch.Tensor | None = None) -> nn.Module:
        layer.weight.data = weight  # replaces (frees) the float weight of the online method
        layer.register_buffer("weight_scale", scale, persistent=False)
        return self.runner_class(weight, scale, activations=self.activations, input_scale=input_scale)


class Fp8OnlineMethod(_Fp8Method):
    """quantization="fp8" on a float checkpoint: the layer loads its float weight as usual (its
    tensor-parallel shard); finalize quantizes each of its rows."""

    float_weight = True

    def finalize(self, layer: Linear) -> nn.Module:
        weight, scale = quantize_per_row(layer.weight.data)
        return self._runner(layer, weight, scale)


class Fp8CheckpointMethod(_Fp8Method):
    """One layer's FP8 checkpoint tensors: `weight` float8_e4m3fn, `weight_scale` (one value, or
    one per output row; any float dtype) and, for static activations, `input_scale` (one value).
    compressed_tensors_int8.py reads int8 checkpoints through the same steps, its own dtype, layout
    name, dummy quantizer and runner in the class attributes and hooks below."""

    weight_dtype = FP8_DTYPE
    layout = "fp8"  # (for messages)
    dummy_input_scale = _DUMMY_INPUT_SCALE

    def __init__(self, activations: str, weight_params: tuple[str, ...] = ("weight",)):
        super().__init__(activations)
        static = activations == "static"
        self.weight_params = weight_params
        self.checkpoint_params = (*weight_params, "weight_scale", *(("input_scale",) if static else ()))
        # A dynamic-scheme checkpoint may still carry calibration scales: read, not used (as vLLM).
        self.optional_params = () if static else ("input_scale",)
        self._weight: torch.Tensor | None = None
        self._scale: torch.Tensor | None = None
        self._input_scale: float | None = None

    def _tensors(self, layer: Linear) -> tuple[torch.Tensor, torch.Tensor]:
        # Allocated at the first load: the layer is not fully built when it chooses its method.
        if self._weight is None or self._scale is None:
            device = layer.weight.device
            self._weight = torch.empty(layer.out_features, layer.in_features, dtype=self.weight_dtype, device=device)
            self._scale = torch.empty(layer.out_features, dtype=torch.float32, device=device)
        return self._weight, self._scale

    def _rank_part(self, layer: Linear, param_name: str, tensor: Weight, first: int, held: int,
                   full: int) -> torch.Tensor:
        """This rank's part of the checkpoint weight `param_name` (one of weight_params), unpacked."""
        return _rank_weight(layer, tensor, first, held, full)

    @staticmethod
    def _quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weight_dtype codes, float32 row scales) of a float weight: for dummy weights."""
        return quantize_per_row(weight)

    def load(self, layer: Linear, param_name: str, tensor: Weight, shard: str | None) -> None:
        if param_name == "input_scale":
            value = materialize(tensor).float()
            if value.numel() != 1 or not bool(torch.isfinite(value).all()) or float(value.max()) <= 0:
                raise ValueError(f"input_scale must be one positive value (per-tensor), got shape "
                                 f"{tuple(value.shape)}")
            v = float(value.max())
            self._input_scale = v if self._input_scale is None else max(self._input_scale, v)
            return
        weight, scale = self._tensors(layer)
        dst, rows = layer._shard_rows()[shard or "weight"]
        first, held, full = _checkpoint_rows(layer, shard)
        if param_name in self.weight_params:
            value = self._rank_part(layer, param_name, tensor, first, held, full)
            if value.dtype != self.weight_dtype:
                stores = str(self.weight_dtype).removeprefix("torch.")
                raise ValueError(f"weight is {value.dtype}, the {self.layout} layout stores {stores} (a layer the "
                                 "checkpoint leaves unquantized must be named in its ignore list)")
            if tuple(value.shape) != (rows, layer.in_features):
                raise ValueError(f"weight: checkpoint shape {shape_of(tensor)}, model expects "
                                 f"{(full, layer.in_features * _column_split(layer))}")
            weight[dst:dst + rows].copy_(value)
        elif param_name == "weight_scale":
            scale[dst:dst + rows].copy_(_row_scales(tensor, first, held, full))
        else:
            raise ValueError(f"{param_name}: not a tensor of the {self.layout} layout")

    def dummy(self, layer: Linear, seed: int) -> None:
        gen = torch.Generator(device=layer.weight.device).manual_seed(seed)
        w = torch.empty(layer.out_features, layer.in_features, dtype=torch.bfloat16, device=layer.weight.device)
        self._weight, self._scale = self._quantize_rows(w.normal_(0.0, 0.02, generator=gen))
        if self.activations == "static":
            self._input_scale = self.dummy_input_scale

    def finalize(self, layer: Linear) -> nn.Module:
        if self._weight is None or self._scale is None:
            raise ValueError(f"an {self.layout} layer was finalized before its checkpoint tensors were loaded")
        input_scale = None
        if self.activations == "static":
            if self._input_scale is None:
                raise ValueError("static activations: the layer's input_scale never arrived")
            input_scale = torch.tensor([self._input_scale], dtype=torch.float32, device=self._weight.device)
        runner = self._runner(layer, self._weight, self._scale, input_scale)
        self._weight = self._scale = None  # the layer and its runner hold them now
        return runner


def _checkpoint_rows(layer: Linear, shard: str | None) -> tuple[int, int, int]:
    """(first checkpoint row this rank holds, rows held, checkpoint rows) of `shard`."""
    rows = getattr(layer, "checkpoint_rows", None)
    if rows is not None and shard is not None:
        return rows[shard]
    return 0, layer.out_features, layer.out_features


def _column_split(layer: Linear) -> int:
    """How many ranks share the layer's input columns: a row-parallel layer's group size."""
    return layer.tp.size if isinstance(layer, RowParallelLinear) else 1


def _rank_weight(layer: Linear, tensor: Weight, first: int, held: int, full: int, per_column: int = 1
                 ) -> torch.Tensor:
    """This rank's part of a checkpoint weight (its rows of a column-parallel shard, its columns of
    a row-parallel layer), reading only that part of a lazy safetensors slice. per_column: inputs
    stored per column (4 for int8 packed into int32 words; each rank's inputs then start and end
    on a whole word)."""
    shape = shape_of(tensor)
    if isinstance(layer, RowParallelLinear) and layer.tp.size > 1 and len(shape) == 2 and (
            shape[1] == -(-layer.in_features * layer.tp.size // per_column)):
        start, count = layer.in_start, layer.in_features
        if start % per_column or count % per_column:
            raise ValueError(f"a rank's {count} input columns from {start} do not fall on whole words of "
                             f"{per_column}")
        value = narrow(tensor, 1, start // per_column, count // per_column)
    elif len(shape) == 2 and held != full and shape[0] == full:
        value = narrow(tensor, 0, first, held)
    else:
        value = materialize(tensor)
    return value.contiguous()


def _row_scales(tensor: Weight, first: int, held: int, full: int) -> torch.Tensor:
    """float32 [held]: a per-tensor scale repeated, or this rank's rows of per-row scales
    ([full] or [full, 1])."""
    value = materialize(tensor).float()
    if value.numel() == 1:
        return value.reshape(1).expand(held)
    if value.dim() in (1, 2) and value.shape[0] == full and value.numel() == full:
        return value.reshape(full)[first:first + held]
    raise ValueError(f"weight_scale has shape {tuple(value.shape)}: expected one value (per tensor) or {full} "
                     "(per output channel)")


# ---- the model's config -------------------------------------------------------------------------
_WHERE = "config.json quantization_config"
# The fields of the "fp8" layout ferrox understands; any other is refused by name.
_FP8_FIELDS = ("quant_method", "activation_scheme", "fmt", "weight_block_size", "ignored_layers",
               "modules_to_not_convert", "kv_cache_scheme", "dequantize")
_ACTIVATION_NAMES = {"dynamic-token": "dynamic per-token activations", "dynamic-tensor":
                     "dynamic per-tensor activations", "static": "static per-tensor activations",
                     "weight-only": "weight-only (activations unquantized)"}


_TRANSFORMERS_PER_TENSOR_NAMES = ((".weight_scale_inv", ".weight_scale"), (".activation_scale", ".input_scale"))


class Fp8Config(QuantConfig):
    """FP8 E4M3 weights with per-row scales, online or from a checkpoint (see the module docstring)."""

    name = "fp8"

    def __init__(self, *, online: bool, activations: str, excluded: ExcludeList | None = None):
        """excluded: the checkpoint's modules left in float (its ignore list; QuantConfig.keep_unquantized)."""
        if activations not in ACTIVATIONS:
            raise ValueError(f"activations must be one of {', '.join(ACTIVATIONS)}, got {activations!r}")
        self.online_quantization = online
        self.activations = activations
        self.excluded = excluded
        if not online:
            # transformers 5 saves per-tensor FP8 (its FP8Linear without blocks) as `weight_scale_inv` (the
            # dequantizing multiplier, despite the name) and `activation_scale` (the static input scale):
            # Ministral 3's and Mistral-Medium-3.5's releases. The same tensors as AutoFP8's, renamed as vLLM does.
            self.checkpoint_renames = _TRANSFORMERS_PER_TENSOR_NAMES

    @classmethod
    def online(cls) -> Fp8Config:
        """quantization="fp8" on a float checkpoint (vLLM's online FP8: dynamic per-token activations)."""
        return cls(online=True, activations="dynamic-token")

    @classmethod
    def from_hf(cls, cfg: dict) -> QuantConfig:
        """config.json quantization_config of the "fp8" layout (block-wise: fp8_block.py's config)."""
        unknown = sorted(k for k in cfg if k not in _FP8_FIELDS and not k.startswith("_"))
        if unknown:
            raise UnsupportedModelError(f"{_WHERE}: field(s) {', '.join(unknown)} of the fp8 layout are not supported "
                                        f"(ferrox reads {', '.join(_FP8_FIELDS)}; report the checkpoint)")
        fmt = cfg.get("fmt", "e4m3")
        # DeepSeek-V3 writes "e4m3"; MiniMax-M2's releases write the torch dtype name, "float8_e4m3fn".
        if str(fmt).lower() not in ("e4m3", "float8_e4m3fn"):
            raise UnsupportedModelError(f"{_WHERE}.fmt {fmt!r}: only E4M3 FP8 weights are supported")
        scheme = cfg.get("activation_scheme", "dynamic")  # transformers' default
        if scheme not in ("dynamic", "static"):
            raise UnsupportedModelError(f"{_WHERE}.activation_scheme {scheme!r}: expected 'dynamic' or 'static'")
        refuse_kv_cache_scheme(cfg.get("kv_cache_scheme"), f"{_WHERE}.kv_cache_scheme")
        excluded = _skipped_modules(cfg)
        if cfg.get("weight_block_size") is not None:
            from ferrox.layers.quant.fp8_block import Fp8BlockConfig  # (it builds on this module)

            if scheme != "dynamic":
                raise UnsupportedModelError(f"{_WHERE}.activation_scheme {scheme!r} with weight_block_size: block-wise "
                                            "FP8 quantizes activations per token group at run time ('dynamic')")
            return Fp8BlockConfig(Fp8BlockConfig.block_size(cfg["weight_block_size"], f"{_WHERE}.weight_block_size"),
                                  excluded)
        return cls(online=False, activations="static" if scheme == "static" else "dynamic-token", excluded=excluded)

    def check(self, spec: ModelSpec, device: torch.device, tp_size: int) -> None:
        check_fp8_device(self.name, device)

    def linear_method(self, layer: Linear) -> LinearWeightMethod:
        if self.online_quantization:
            return Fp8OnlineMethod(self.activations)
        return Fp8CheckpointMethod(self.activations)

    def moe_method(self, layer: FusedMoE) -> Fp8MoeMethod:
        """FP8 experts, a scale per row (fp8_moe.py); activations per token only (what the expert
        kernels quantize at run time). A static checkpoint's experts (Mistral Small 4's release) keep their
        calibrated input scales unused: they quantize per token too, finer than one scale (vLLM runs them
        with the largest of those scales), while its linear layers take their static scales."""
        from ferrox.layers.quant.fp8_moe import Fp8MoeMethod

        if self.activations not in ("dynamic-token", "static"):
            raise UnsupportedModelError(f"quantization {self.name!r}: {_ACTIVATION_NAMES[self.activations]} are not "
                                        "supported for mixture-of-experts layers (their experts quantize activations "
                                        "per token at run time)")
        return Fp8MoeMethod(None, online=self.online_quantization)

    def describe(self) -> str:
        source = "quantized at load" if self.online_quantization else "checkpoint"
        return f"{self.name} ({source}): E4M3 weights, per-channel scales, {_ACTIVATION_NAMES[self.activations]}"


def check_fp8_device(name: str, device: torch.device) -> None:
    """FP8 tensor-core matmuls need compute capability 8.9 (Ada, Hopper) or newer; the CPU runs them
    dequantized."""
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        major, minor = torch.cuda.get_device_capability(device)
        raise UnsupportedModelError(f"quantization {name!r}: FP8 matmuls need a GPU of compute capability "
                                    f"8.9 or newer (Ada, Hopper); this one is {major}.{minor}")


def refuse_kv_cache_scheme(scheme: object, where: str) -> None:
    """A checkpoint's KV-cache quantization: per-tensor FP8 scales (k_scale / v_scale per attention
    layer) are what the KV cache reads (attention/kv_cache.py: used with kv_cache_dtype='fp8', ignored
    otherwise, as vLLM does); any other scheme is refused by name."""
    if scheme is None:
        return
    if (isinstance(scheme, dict) and scheme.get("num_bits") == 8 and scheme.get("type", "float") == "float"
            and scheme.get("strategy", "tensor") == "tensor"):
        return
    raise UnsupportedModelError(
        f"{where} {scheme!r}: only per-tensor 8-bit float KV-cache scales are supported (please report this "
        "checkpoint by name)")


def string_list(value: object, where: str) -> list[str]:
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise UnsupportedModelError(f"{where}: expected a list of module names, got {value!r}")
    return value


def _skipped_modules(cfg: dict) -> ExcludeList:
    """The fp8 layout's modules left in float: `ignored_layers` and `modules_to_not_convert`, substring entries
    (excluded_modules.py). vLLM reads modules_to_not_convert only when ignored_layers is empty; exports write
    one or the other, and both are taken here, so that neither is read and then dropped."""
    fields = ("ignored_layers", "modules_to_not_convert")
    entries = [e for f in fields for e in string_list(cfg.get(f), f"{_WHERE}.{f}")]
    named = " / ".join(f for f in fields if cfg.get(f)) or fields[0]
    return ExcludeList(entries, f"{_WHERE}.{named}", syntax="substring")
